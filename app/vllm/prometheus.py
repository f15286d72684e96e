"""Reading vLLM's /metrics (Prometheus text): one metric's samples, summed, or an info gauge's labels."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from app.core.errors import UpstreamError


def _samples(metrics_text: str, name: str) -> Iterator[Sample]:
    """Every sample named ``name`` (``vllm:prompt_tokens_total``, ``..._count``), as prometheus_client parses it.
    Only those lines go to the parser: all of vLLM's /metrics takes it ~10 ms, and the monitor runs on the loop."""
    wanted = "".join(line + "\n" for line in metrics_text.splitlines() if line.startswith((name + "{", name + " ")))
    try:
        for family in text_string_to_metric_families(wanted):
            yield from (sample for sample in family.samples if sample.name == name)
    except ValueError as exc:  # not Prometheus text (a proxy's error page): vLLM is not what answered
        raise UpstreamError(f"unreadable /metrics: {exc}") from exc


def parse_metric_labels(metrics_text: str, name: str) -> dict[str, str] | None:
    """Labels of the first sample of an info-style gauge, e.g. ``vllm:cache_config_info``."""
    return next((dict(sample.labels) for sample in _samples(metrics_text, name)), None)


def metric_total(metrics_text: str, name: str) -> float:
    """Sum of all samples of a counter (all engines/models)."""
    return sum(sample.value for sample in _samples(metrics_text, name))


def metric_max(metrics_text: str, name: str) -> float | None:
    """The largest sample of a gauge (the fullest engine's ``vllm:kv_cache_usage_perc``); None if absent."""
    return max((sample.value for sample in _samples(metrics_text, name)), default=None)
