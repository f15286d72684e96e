"""What the real vLLM test server is doing, read from its own /metrics: requests running or waiting, prompt tokens
prefilled, tokens generated; and a bounded wait for a condition."""

from __future__ import annotations

import threading
import time

import httpx

from app.vllm.prometheus import metric_total

LONG = 3000  # answer tokens: the CPU test model decodes for far longer than any check below waits
IGNORE_EOS = {"ignore_eos": True}  # the dummy-weight model may pick EOS early; these answers must run long


def vllm_metrics(vllm_url: str) -> str:
    return httpx.get(vllm_url.removesuffix("/v1") + "/metrics", timeout=10).text


def running(vllm_url: str) -> float:
    text = vllm_metrics(vllm_url)
    return metric_total(text, "vllm:num_requests_running") + metric_total(text, "vllm:num_requests_waiting")


def vllm_counters(vllm_url: str) -> tuple[float, float]:
    """(prompt tokens prefilled, tokens generated) so far."""
    text = vllm_metrics(vllm_url)
    return metric_total(text, "vllm:prompt_tokens_total"), metric_total(text, "vllm:generation_tokens_total")


def wait_until(predicate, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``, saying how many times it was checked and the
    longest check (a check that hangs, e.g. a /metrics read vLLM answers late, is not a condition that never held)."""
    started, checks, longest = time.monotonic(), 0, 0.0
    while True:
        began = time.monotonic()
        held = predicate()
        checks, longest = checks + 1, max(longest, time.monotonic() - began)
        if held:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout} s ({checks} checks, the longest {longest:.1f} s)")
        time.sleep(0.1)


class MachineStalls:
    """How long this machine stood still for the test's own process, while in the ``with`` block: a thread sleeping
    in short steps sums how late it woke beyond a small slack. A bound on another process's timing (an app's drain)
    may allow for it, so that it checks what that process did, not whether the 2-core VM beside a CPU vLLM ran at
    all; a process stalled alone (its own lock, its own loop) still fails the bound."""

    STEP_S, SLACK_S = 0.05, 0.05

    def __init__(self) -> None:
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MachineStalls:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            time.sleep(self.STEP_S)
            self.seconds += max(0.0, time.monotonic() - started - self.STEP_S - self.SLACK_S)
