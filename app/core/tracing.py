"""OpenTelemetry traces of answers, off unless an OTLP endpoint is configured (``PREFIXRAG_SERVICE__OTLP_TRACES_URL``).

One trace per answer, with a span per stage (admission, retrieval, arranging the prompt, vLLM until the last token,
its first token an event) and the tokens as attributes (prompt, cached, completion), so a trace shows whether a
slow answer waited, ranked, or prefilled. The spans are written after the answer ended, from the pipeline's own
stage marks: tracing adds one call at the end of a request and no context to carry through it. The exporter's
batch processor sends them from its own thread; the standard ``OTEL_EXPORTER_OTLP_*`` variables (headers,
timeout, compression) apply to it.
"""

from __future__ import annotations

import time
from typing import Any

# (span, the stage mark it starts at, the one it ends at): the marks of app.rag.pipeline.Clock.
STAGES = (("admit", "start", "admitted"), ("retrieve", "admitted", "retrieve"), ("arrange", "retrieve", "assemble"),
          ("vllm", "send", "done"))


class AnswerTraces:
    def __init__(self, url: str | None, service_name: str = "prefixrag") -> None:
        self._tracer: Any = None
        self._provider: Any = None
        if url:  # the SDK is imported only where traces are wanted
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
            self._tracer = self._provider.get_tracer("prefixrag")

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def answer(self, marks: dict[str, float], first_token: float, attributes: dict[str, Any]) -> None:
        """One answer's trace from its stage marks (``time.perf_counter`` seconds; ``marks["done"]`` its end)."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        offset_ns = time.time_ns() - int(time.perf_counter() * 1e9)

        def wall(mark: float) -> int:
            return offset_ns + int(mark * 1e9)

        from asgi_correlation_id import correlation_id

        request_id = {"prefixrag.request_id": found} if (found := correlation_id.get()) else {}
        root = self._tracer.start_span("prefixrag.answer", start_time=wall(marks["start"]),
                                       attributes=attributes | request_id)
        inside = trace.set_span_in_context(root)
        for name, begin, end in STAGES:
            if begin in marks and end in marks:
                span = self._tracer.start_span(name, context=inside, start_time=wall(marks[begin]))
                if name == "vllm":
                    span.add_event("first_token", timestamp=wall(first_token))
                span.end(end_time=wall(marks[end]))
        root.end(end_time=wall(marks["done"]))

    def close(self) -> None:
        """Send what is still batched, then stop the exporter's thread."""
        if self._provider is not None:
            self._provider.shutdown()
