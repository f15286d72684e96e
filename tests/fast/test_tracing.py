"""Traces over OTLP: the app with ``PREFIXRAG_SERVICE__OTLP_TRACES_URL`` set sends, through the OpenTelemetry SDK's
own OTLP/HTTP exporter, one trace per answer to a real HTTP receiver that decodes the protobuf as a collector would."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from app.core.tracing import AnswerTraces
from app.serve.app import create_app
from app.vllm.process import free_port
from tests.support.corpora import app_settings
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer


class Collector(ThreadingHTTPServer):
    """Receives OTLP/HTTP trace exports (``POST /v1/traces``, protobuf) and keeps every span."""

    def __init__(self, port: int) -> None:
        self.spans: list = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["content-length"]))
                export = ExportTraceServiceRequest.FromString(body)
                collector.spans += [span for resource in export.resource_spans for scope in resource.scope_spans
                                    for span in scope.spans]
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def attributes(span) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in span.attributes}


def test_each_answer_is_one_trace_with_its_stages_and_tokens_sent_over_otlp(notes, embedder):
    port = free_port()
    collector = Collector(port)
    chroma, _, _ = notes
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None)
    settings.service.otlp_traces_url = f"http://127.0.0.1:{port}/v1/traces"
    try:
        with AppServer(create_app(settings, embedder=embedder, llm=FakeVLLM())) as server:
            server.wait_ready()
            answers = [httpx.post(server.url + "/ask", json={"question": question, "max_tokens": 8},
                                  headers={"x-request-id": f"trace-me-{n}"}, timeout=30).json()
                       for n, question in enumerate(["What is in the notes?", "Who wrote the notes?"])]
        # The app has stopped: its exporter sent what it still held.
    finally:
        collector.shutdown()
    roots = {attributes(s)["prefixrag.request_id"]: s for s in collector.spans if s.name == "prefixrag.answer"}
    assert set(roots) == {"trace-me-0", "trace-me-1"}
    for n, answer in enumerate(answers):
        root = roots[f"trace-me-{n}"]
        stages = {s.name: s for s in collector.spans if s.trace_id == root.trace_id and s.name != root.name}
        assert set(stages) == {"admit", "retrieve", "arrange", "vllm"}
        assert all(s.parent_span_id == root.span_id for s in stages.values())
        said = attributes(root)
        assert said["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"] > 0
        assert said["prefixrag.cached_tokens"] == answer["usage"]["cached_tokens"]
        assert said["prefixrag.strategy"] == answer["strategy"]
        # The spans are the stages the answer reported, on one clock.
        ms = {name: (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6 for name, s in stages.items()}
        timings = answer["timings_ms"]
        assert abs(ms["retrieve"] - (timings["retrieve"] - timings["admit"])) < 0.05
        assert abs((root.end_time_unix_nano - root.start_time_unix_nano) / 1e6 - timings["total"]) < 0.05
        first = next(e for e in stages["vllm"].events if e.name == "first_token")
        assert abs((first.time_unix_nano - root.start_time_unix_nano) / 1e6 - timings["ttft"]) < 0.05


def test_without_an_endpoint_nothing_is_traced():
    traces = AnswerTraces(None)
    assert not traces.on
    traces.answer({"start": 0.0, "done": 1.0}, 0.5, {})  # nothing to send it to: nothing happens
    traces.close()
