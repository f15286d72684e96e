"""Refusals and liveness in the HTTP parser (``app.serve.refusal_protocol``), on raw HTTP/1.1 connections against the
fake vLLM: a refused request's body is dropped and the connection serves the next one; answers keep their order on
a connection; ``Connection: close`` is honoured; with CORS configured the app refuses (its headers are needed); a
liveness probe answered as the app's route would."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from app.serve.app import create_app
from app.serve.refusal_protocol import refusing_protocol
from tests.support.corpora import app_settings
from tests.support.fake_app import hold_the_place, place_taken
from tests.support.fakes import GatedVLLM
from tests.support.servers import AppServer, http_requests


def request(question: str, *headers: str) -> bytes:
    body = json.dumps({"question": question, "max_tokens": 4}).encode()
    head = ["POST /ask HTTP/1.1", "host: test", "content-type: application/json", f"content-length: {len(body)}",
            *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def read_response(reader) -> tuple[int, dict[str, str], bytes]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().decode().strip()):
        name, _, value = line.partition(":")
        headers[name.lower()] = value.strip()
    return status, headers, reader.read(int(headers["content-length"]))


def at_capacity(notes, embedder, **service):
    """An app with one place, and a question holding it until ``llm.gate`` is set."""
    chroma, _, _ = notes
    llm = GatedVLLM()
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None)
    settings.traffic.max_in_flight, settings.traffic.max_queued = 1, 0
    for name, value in service.items():
        setattr(settings.service, name, value)
    return AppServer(create_app(settings, embedder=embedder, llm=llm)), llm


def test_a_refused_requests_body_is_dropped_and_its_connection_serves_the_next_in_order(notes, embedder):
    server, llm = at_capacity(notes, embedder)
    with server, ThreadPoolExecutor(1) as pool, socket.create_connection(("127.0.0.1", server.port), 30) as conn:
        server.wait_ready()
        reader = conn.makefile("rb")
        held = hold_the_place(server, pool)
        conn.sendall(request("First?") + request("Second?", "x-request-id: mine"))  # pipelined, bodies and all
        refused = [read_response(reader), read_response(reader)]
        llm.gate.set()
        assert held.result(timeout=30).status_code == 200
        conn.sendall(request("Third?"))
        answered = read_response(reader)
        llm.gate.clear()
        held = hold_the_place(server, pool)
        conn.sendall(request("Fourth?", "connection: close"))
        closing = read_response(reader)
        conn.settimeout(2)  # well inside the keep-alive time: the server closes the connection after the refusal
        closed = reader.read()
        llm.gate.set()
        held.result(timeout=30)
    assert [status for status, _, _ in refused] == [429, 429]
    assert all(int(headers["retry-after"]) >= 1 and json.loads(body)["error"]["code"] == "overloaded"
               for _, headers, body in refused)
    assert refused[1][1]["x-request-id"] == "mine" and len(refused[0][1]["x-request-id"]) == 32
    assert answered[0] == 200 and json.loads(answered[2])["answer"]
    assert closing[0] == 429 and closing[1]["connection"] == "close" and closed == b""
    assert server.app.state.services.traffic.refused == 3


def test_a_request_behind_one_still_answered_on_its_connection_waits_its_turn(notes, embedder):
    """HTTP/1.1 answers in order: a question pipelined behind the one holding the place is not refused ahead of
    that answer; it goes to the app once that answer is out, and the place is free by then."""
    server, llm = at_capacity(notes, embedder)
    with server, socket.create_connection(("127.0.0.1", server.port), 30) as conn:
        server.wait_ready()
        reader = conn.makefile("rb")
        conn.sendall(request("Holding?"))
        place_taken(server)
        conn.sendall(request("Behind?"))
        time.sleep(0.5)  # were it refused at once, its 429 would be written now, ahead of the held answer
        llm.gate.set()
        responses = [read_response(reader), read_response(reader)]
    assert [status for status, _, _ in responses] == [200, 200]
    assert server.app.state.services.traffic.refused == 0


def test_with_cors_configured_the_app_refuses_with_its_headers(notes, embedder):
    server, llm = at_capacity(notes, embedder, cors_origins=["http://page.test"])
    assert refusing_protocol(server.app) == "auto"
    with server, ThreadPoolExecutor(1) as pool, socket.create_connection(("127.0.0.1", server.port), 30) as conn:
        server.wait_ready()
        reader = conn.makefile("rb")
        held = hold_the_place(server, pool)
        conn.sendall(request("Refused?", "origin: http://page.test"))
        status, headers, _ = read_response(reader)
        llm.gate.set()
        held.result(timeout=30)
    assert status == 429 and headers["access-control-allow-origin"] == "http://page.test"


@pytest.mark.parametrize("http", [None, "httptools"])
def test_a_liveness_probe_is_answered_in_the_parser_as_the_app_would_answer_it(notes, embedder, http):
    """``GET /healthz`` as ``python -m app`` serves it never reaches the app (else the app's route answers): the
    same status and body, a request id (the client's own or a new one), counted in the HTTP metrics; other methods
    and paths still go to the app."""
    server, _ = at_capacity(notes, embedder)
    app, reached = server.app, []

    async def counted_app(scope, receive, send):  # what uvicorn hands to the app
        reached.append((scope.get("method"), scope.get("path")))
        await app(scope, receive, send)

    with AppServer(app, http=http, asgi=counted_app) as server:
        before = http_requests(httpx.get(server.url + "/metrics", timeout=10).text)
        reached.clear()  # AppServer's own start-up probes
        probes = [httpx.get(server.url + "/healthz", timeout=10),
                  httpx.get(server.url + "/healthz?from=lb", headers={"X-Request-ID": "probe-1"}, timeout=10)]
        posted = httpx.post(server.url + "/healthz", timeout=10)
        after = http_requests(httpx.get(server.url + "/metrics", timeout=10).text)
    assert [(p.status_code, p.json()) for p in probes] == [(200, {"status": "ok"})] * 2
    assert len(probes[0].headers["x-request-id"]) == 32 and probes[1].headers["x-request-id"] == "probe-1"
    assert after.get(("/healthz", "GET", "200"), 0) - before.get(("/healthz", "GET", "200"), 0) == 2
    assert posted.status_code == 405
    assert reached.count(("GET", "/healthz")) == (0 if http is None else 2)
    assert ("POST", "/healthz") in reached
