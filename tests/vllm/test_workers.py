"""Ranking in worker processes (``python -m app --workers 2``) against a real vLLM CPU server: the service
answers as one process does, pre-warm runs once, admission is the service's (a 429 past its capacity, whichever
worker would rank), /metrics counts every answer, and SIGTERM to the whole process group lets a request in
flight finish before the service and both workers exit."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from app.vllm.process import app_child, free_port
from app.vllm.prometheus import metric_total
from tests.support.servers import PROBE_TIMEOUT
from tests.support.vllm_state import IGNORE_EOS, LONG, running, wait_until

pytestmark = pytest.mark.vllm


def children(pid: int) -> dict[int, str]:
    """Child processes of ``pid`` and their command lines, from /proc."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = cmdline
    return found


def ask(url: str, question: str, **fields) -> httpx.Response:
    return httpx.post(url + "/ask", json={"question": question} | fields, timeout=120)


def test_two_workers_one_prewarm_global_admission_summed_metrics_and_a_draining_stop(collections, vllm_url,
                                                                                    tmp_path):
    log = tmp_path / "app.log"
    port = free_port()
    env = {"PREFIXRAG_VLLM_URL": vllm_url, "PREFIXRAG_CHROMA_PATH": str(collections), "PREFIXRAG_COLLECTION": "facts",
           "PREFIXRAG_RETRIEVAL__WORKERS": "2", "PREFIXRAG_TRAFFIC__MAX_IN_FLIGHT": "1",
           "PREFIXRAG_TRAFFIC__DRAIN_S": "120",
           "PREFIXRAG_SAMPLING__EXTRA_SAMPLING": json.dumps(IGNORE_EOS)}
    app = app_child(log, env, port).start()
    url = f"http://127.0.0.1:{port}"
    try:
        app.wait_for(url + "/healthz", 120)
        wait_until(lambda: httpx.get(url + "/readyz", timeout=PROBE_TIMEOUT).status_code == 200, 180,
                   "the app ready (both workers primed)")
        workers = {pid for pid, cmd in children(app.pid).items() if "multiprocessing.spawn" in cmd}
        assert len(workers) == 2, children(app.pid)
        wait_until(lambda: httpx.get(url + "/readyz", timeout=PROBE_TIMEOUT).json()["warmup"]["state"] == "done",
                   180, "pre-warm done")
        answers = [ask(url, q, max_tokens=4) for q in ("What do anchors do?", "Why do tides rise?",
                                                       "Where does a compass point?", "What do anchors do?")]
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        assert answers[0].json()["sources"][0]["document"] == "anchors.md"
        assert answers[0].json()["sources"] == answers[3].json()["sources"]  # whichever worker ranked it
        metrics = httpx.get(url + "/metrics", timeout=PROBE_TIMEOUT).text
        assert metric_total(metrics, "prefixrag_request_seconds_count") == 4  # every answer, counted once
        wait_until(lambda: running(vllm_url) == 0, 30, "an idle vLLM")
        with httpx.stream("POST", url + "/ask", json={"question": "What do sails do?", "max_tokens": LONG,
                                                      "stream": True}, timeout=60) as holder:
            assert holder.status_code == 200, holder.read()
            lines = holder.iter_lines()  # kept: a dropped iterator closes the response, and the place with it
            next(lines)  # the one place is taken, for as long as this answer decodes
            refused = ask(url, "What do anchors do?")
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "overloaded"
        wait_until(lambda: running(vllm_url) == 0, 30, "the abandoned answer aborted")
        with httpx.stream("POST", url + "/ask", json={"question": "What do tides do?", "max_tokens": 48,
                                                      "stream": True}, timeout=120) as draining:
            lines = draining.iter_lines()
            next(lines)
            os.killpg(app.pid, signal.SIGTERM)  # as a container stop or systemd does: every process at once
            rest = list(lines)
        assert "event: done" in rest, rest[-3:]  # the answer in flight finished
        wait_until(lambda: not app.running, 60, "the app exiting once drained")
        time.sleep(1)
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], "the workers stopped with it"
    finally:
        app.kill()
    text = log.read_text()
    assert text.count("pre-warm done") == 1, text[-3000:]
