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


@pytest.mark.vllm
def test_several_api_servers_answer_on_one_port_each_with_the_detokenizer_fix(tmp_path):
    """PREFIXRAG_VLLM_SERVER__API_SERVER_COUNT=2: the launcher starts vLLM as `vllm serve --api-server-count 2` does,
    and each of the two front-end processes installs the tail-primed detokenizer before it serves."""
    import httpx

    from app.vllm.process import LocalVLLM

    log = tmp_path / "vllm.log"
    with LocalVLLM(log, max_model_len=2048, startup_timeout_s=600,
                   env={"PREFIXRAG_VLLM_SERVER__API_SERVER_COUNT": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}) as url:
        for _ in range(4):  # answered whichever front end the kernel hands the connection to
            reply = httpx.post(f"{url}/completions", json={"model": "prefixrag-test-model", "prompt": "hello",
                                                           "max_tokens": 2}, timeout=120)
            assert reply.status_code == 200, reply.text
    primed = [line for line in log.read_text().splitlines() if "detokenizer primed" in line]
    assert len(primed) == 2 and all(line.endswith(": on") for line in primed), primed
    assert "--api-server-count 2" in log.read_text()
