"""``python -m app.vllm_server`` builds the command prefixrag relies on, per backend; ``app.vllm.testmodel`` writes
models of the shapes the benchmarks use. (The CPU command itself is exercised by every vLLM test.)"""

from __future__ import annotations

import pytest


@pytest.mark.vllm
def test_the_cpu_server_runs_native_matmuls_on_this_machine(vllm_server):
    """Wherever the suite runs, the launcher's dtype keeps vLLM off its emulated path (on an AVX2-only CPU bf16
    fell back to torch's linear, prefill 3x slower: README, "Serving vLLM")."""
    _, log = vllm_server
    started = log.read_text()
    assert "--dtype" in started and "fallback to torch linear" not in started
