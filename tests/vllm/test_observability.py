"""What operators see, with real parts (vLLM test server, Chroma, the embedder): every request counted by route,
method and status, streams included; a request id on every response and log line; a summary line per answer;
no access lines for successful probes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import openai
import pytest

from app.serve.app import create_app
from app.vllm.process import free_port, wait_for_http
from tests.support.corpora import app_settings
from tests.support.env import ROOT
from tests.support.servers import AppServer, http_requests

pytestmark = pytest.mark.vllm
KEY = {"Authorization": "Bearer k"}


def test_every_route_is_counted_by_method_and_status_streams_included_and_has_a_request_id(collections, vllm_url,
                                                                                               embedder):
    settings = app_settings(collections, vllm_url)
    settings.service.api_key = "k"
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        before = http_requests(httpx.get(f"{server.url}/metrics", headers=KEY, timeout=10).text)
        ok = httpx.post(f"{server.url}/ask", json={"question": "Why are there tides?"}, headers=KEY, timeout=60)
        bad = httpx.post(f"{server.url}/ask", json={"question": ""}, headers=KEY, timeout=60)
        keyless = httpx.post(f"{server.url}/ask", json={"question": "hi"}, timeout=60)
        traced = httpx.get(f"{server.url}/healthz", headers={"X-Request-ID": "trace-42"}, timeout=10)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=60)
        chunks = list(client.chat.completions.create(model="prefixrag", stream=True, max_tokens=4,
                                                     messages=[{"role": "user", "content": "What is a compass?"}]))
        exposed = httpx.get(f"{server.url}/metrics", headers=KEY, timeout=10).text
        after = http_requests(exposed)
    assert "process_resident_memory_bytes" in exposed and "process_cpu_seconds_total" in exposed
    counted = {key: value - before.get(key, 0.0) for key, value in after.items()}
    assert (ok.status_code, bad.status_code, keyless.status_code) == (200, 400, 401) and chunks
    assert counted[("/ask", "POST", "200")] == 1 and counted[("/ask", "POST", "400")] == 1
    assert counted[("/ask", "POST", "401")] == 1  # refused at the edge, before any route: still counted
    assert counted[("/v1/chat/completions", "POST", "200")] == 1  # a stream, counted once it ended
    assert counted[("/healthz", "GET", "200")] == 1
    assert traced.headers["x-request-id"] == "trace-42"  # a client's own id is kept
    assert len(ok.headers["x-request-id"]) == 32 and ok.headers["x-request-id"] != bad.headers["x-request-id"]
    assert keyless.headers["x-request-id"]


def test_the_log_has_the_request_id_on_each_line_one_summary_per_answer_and_no_probe_noise(collections, vllm_url,
                                                                                           tmp_path):
    """... and the id goes on to vLLM with the request (``X-Request-Id``: vLLM's own logs and ids carry it)."""
    port, sent = free_port(), tmp_path / "sent.jsonl"
    env = os.environ | {"PREFIXRAG_VLLM_URL": vllm_url, "PREFIXRAG_CHROMA_PATH": str(collections),
                        "PREFIXRAG_COLLECTION": "facts", "PREFIXRAG_LIMITS__MAX_TOKENS": "4",
                        "PREFIXRAG_CONTEXT__HOTNESS_DIR": "", "PYTHONUNBUFFERED": "1",
                        "PREFIXRAG_VLLM__CAPTURE_PATH": str(sent)}
    process = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port)], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_http(f"http://127.0.0.1:{port}/healthz", 120, process)
        for _ in range(3):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10)
        answered = httpx.post(f"http://127.0.0.1:{port}/ask", json={"question": "Why are there tides?"},
                              headers={"X-Request-ID": "trace-7"}, timeout=120)
        assert answered.status_code == 200, answered.text
    finally:
        process.terminate()
        log = process.communicate(timeout=60)[0]
    lines = log.splitlines()
    summary = [line for line in lines if "answered: strategy=" in line]
    assert len(summary) == 1 and "[trace-7]" in summary[0] and "cached=" in summary[0], log[-3000:]
    assert any("[trace-7]" in line and '"POST /ask HTTP/1.1" 200' in line for line in lines), log[-3000:]
    assert not any('"GET /healthz' in line for line in lines), "successful probes are not logged"
    answers = [json.loads(line) for line in sent.read_text().splitlines()]
    assert [request["headers"].get("X-Request-Id") for request in answers][-1] == "trace-7", answers[-1]["headers"]
