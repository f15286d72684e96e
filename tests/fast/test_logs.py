"""Repeated failures are aggregated in the log: ``python -m app`` with its vLLM down (nothing listens at its URL)
under four clients writes the first failure of each kind, a count per interval and the end, not a line per
request. No vLLM is involved (it is down by design): tested here only."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from app.serve.repeats import Repeats
from app.vllm.process import app_child, free_port

ROOT = Path(__file__).resolve().parents[2]


def access(status: int, path: str = "/ask") -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5", "POST", path, "1.1", status), None)


def test_one_kind_is_logged_once_then_counted_then_its_end_said(caplog):
    repeats = Repeats(interval_s=10)
    assert repeats.filter(access(503)) and repeats.filter(access(200)) and repeats.filter(access(503, "/v1/x"))
    assert not any(repeats.filter(access(503)) for _ in range(5))  # held back: the same status on the same path
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        now = time.monotonic()
        repeats.flush(now + 11)  # the interval passed with nothing new: both kinds have stopped
    lines = [r.getMessage() for r in caplog.records]
    assert any("repeated (stopped: 6 in" in line and "POST /ask" in line for line in lines), lines
    assert len(lines) == 1, "the /v1/x 503 came once: nothing to say of it"
    assert repeats.filter(access(503))  # a new episode starts with its first line


def test_a_failure_logged_while_the_summary_thread_holds_the_lock_is_counted_without_waiting(caplog):
    """The serving loop never waits on the summary thread: what it logs meanwhile is counted at the next summary."""
    repeats = Repeats(interval_s=10)
    assert repeats.filter(access(503))
    seen: list[bool] = []
    logging_ = threading.Thread(target=lambda: seen.extend(repeats.filter(access(s)) for s in (503, 503, 503, 429)))
    with repeats._lock:  # as the summary thread holds it, mid-flush
        logging_.start()
        logging_.join(2)
        finished = not logging_.is_alive()
    logging_.join()
    assert finished, "the logging thread waited for the lock"
    assert seen == [False, False, False, True]  # held back, and the first of a new kind logged
    with caplog.at_level(logging.INFO, logger="uvicorn.access"):
        repeats.flush(time.monotonic() + 11)
    lines = sorted(r.getMessage() for r in caplog.records)
    assert len(lines) == 1 and "repeated (stopped: 4 in" in lines[0] and '" 503' in lines[0], lines


def test_an_outage_under_four_clients_is_a_handful_of_lines_not_one_per_request(tmp_path):
    port, log = free_port(), tmp_path / "app.log"
    env = {"PREFIXRAG_VLLM_URL": f"http://127.0.0.1:{free_port()}/v1",
           "PREFIXRAG_CHROMA_PATH": str(tmp_path / "chroma"), "PREFIXRAG_SERVICE__LOG_REPEATS_S": "1",
           "PREFIXRAG_VLLM__RETRY_INTERVAL_S": "30"}
    app = app_child(log, env, port).start()
    url = f"http://127.0.0.1:{port}"
    sent, stop = [], threading.Event()

    def client() -> None:
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                sent.append(http.post(url + "/ask", json={"question": "Are you there?"}).status_code)

    try:
        app.wait_for(url + "/healthz", 120)
        before = len(log.read_text().splitlines())
        clients = [threading.Thread(target=client) for _ in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(3)
        stop.set()
        for thread in clients:
            thread.join()
        time.sleep(2.5)  # an interval with nothing: the end of the outage is said
    finally:
        app.stop()
    lines = log.read_text().splitlines()[before:]
    failures = [line for line in lines if "/ask" in line or re.search(r"\b503\b", line)]  # not a pid like 14503
    assert set(sent) == {503} and len(sent) > 40, (len(sent), set(sent))
    # Two kinds (the access line and the failure's reason): the first of each, a count a second (3 s of traffic
    # and the clients' join can touch five ticks), their end.
    assert len(failures) <= 2 * (1 + 5 + 1), "\n".join(failures)
    assert any("repeated (stopped:" in line and "POST /ask" in line for line in failures), "\n".join(failures)


LOGS_THEN_SIGNAL = """
import logging, os, signal
from app.serve.observability import configure_logging
logs = configure_logging(repeats_s=30)
for _ in range(2):
    logging.getLogger("prefixrag.http").warning("%s %s: %s", 503, "shutting_down", "retry shortly")
try:
    raise ValueError("kept with its line")
except ValueError:
    logging.getLogger("prefixrag").exception("a failure")
logs.close()
logging.getLogger("prefixrag").info("after the close")
os.kill(os.getpid(), signal.SIGTERM)  # as uvicorn ends: the signal re-raised, so no atexit
"""


def test_a_process_ended_by_its_signal_has_written_every_queued_line_once_formatted():
    """The writer thread's queue is emptied by ``Logs.close``, the repeats' closing count included, and lines
    after it are written directly; each line carries the format once (time, level, request id, name)."""
    done = subprocess.run([sys.executable, "-c", LOGS_THEN_SIGNAL], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    lines = done.stderr.splitlines()
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert sum("503 shutting_down" in line for line in lines) == 2, done.stderr  # the first, then its count
    assert any("repeated (stopped: 2 in" in line for line in lines), done.stderr
    assert any("ValueError: kept with its line" in line for line in lines), done.stderr
    assert any(line.endswith("INFO [-] prefixrag: after the close") for line in lines), done.stderr
    assert not any("WARNING:prefixrag" in line or "INFO:prefixrag" in line for line in lines), done.stderr


JSON_LINES = """
import json
import logging
from asgi_correlation_id import correlation_id
from app.serve.observability import configure_logging
logs = configure_logging("warning", form="json")
logging.getLogger("prefixrag").info("below the level: not written")
correlation_id.set("req-7")
logging.getLogger("prefixrag.http").warning("%s %s", 503, "shutting_down")
try:
    raise ValueError("kept with its line")
except ValueError:
    logging.getLogger("prefixrag").exception("a failure")
logs.close()
"""


def test_json_logs_are_one_object_per_line_with_the_request_id_and_the_level_kept():
    done = subprocess.run([sys.executable, "-c", JSON_LINES], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stderr.splitlines()]  # every line a whole object
    assert [(r["level"], r["logger"], r["request_id"]) for r in records] == [
        ("WARNING", "prefixrag.http", "req-7"), ("ERROR", "prefixrag", "req-7")], records
    assert records[0]["message"] == "503 shutting_down" and records[0]["time"]
    assert records[1]["message"].startswith("a failure") and "ValueError: kept with its line" in records[1]["message"]
