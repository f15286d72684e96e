"""vLLM's KV tier in host memory (its KV offloading): the launcher turns it on, the service reads its size in
tokens from what vLLM reports and the served model's config, and pre-warm's budget and /metrics count it."""

from __future__ import annotations

import subprocess
import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families

from app.core.settings import VLLMServerSettings
from app.vllm.kv_tiers import host_tier_gib, host_tier_tokens, kv_bytes_per_token, model_config
from app.vllm.launcher import build_command, offload_gib
from app.vllm.testmodel import write_test_model
from tests.fast.test_launcher import flags
from tests.support.env import ROOT
from tests.support.fake_app import serve

LLAMA_8B_TOKEN_BYTES = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16


def test_a_token_of_the_8b_shape_takes_128_kib_and_the_tier_in_tokens_follows_its_gib(tmp_path):
    folder = write_test_model(tmp_path / "llama8b", shape="llama-3.1-8b")
    config = model_config(str(folder))
    assert config and kv_bytes_per_token(config, "auto") == LLAMA_8B_TOKEN_BYTES
    assert kv_bytes_per_token(config, "fp8_e4m3") == LLAMA_8B_TOKEN_BYTES // 2
    assert host_tier_tokens(32.0, str(folder), "auto") == 32 * (1 << 30) // LLAMA_8B_TOKEN_BYTES
    assert host_tier_tokens(32.0, str(tmp_path / "no-such-model"), "auto") == 0  # unknown size: GPU only
    assert host_tier_tokens(0.0, str(folder), "auto") == 0
    assert host_tier_gib({"kv_offloading_size": "None"}) == 0 and host_tier_gib({"kv_offloading_size": "2.5"}) == 2.5


def test_the_launcher_adds_vllms_native_offloading_on_a_gpu_and_refuses_it_on_the_cpu(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 134217728 kB\nMemAvailable: 104857600 kB\n")
    assert offload_gib("auto", str(meminfo)) == 50.0 and offload_gib(12.5) == 12.5
    cfg = VLLMServerSettings(model=str(tmp_path), kv_offload_gib=24)
    gpu = flags(build_command(cfg, gpu=True)[0])
    assert gpu["--kv-offloading-backend"] == "native" and gpu["--kv-offloading-size"] == "24.0"
    assert "--kv-offloading-size" not in flags(build_command(VLLMServerSettings(model=str(tmp_path)), gpu=True)[0])
    refused = subprocess.run([sys.executable, "-m", "app.vllm_server", "--model", str(tmp_path), "--kv-offload-gib",
                              "8", "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs a GPU" in refused.stderr  # this machine has none


def test_pre_warm_budget_and_metrics_count_the_host_tier(notes, embedder, tmp_path):
    server, fake = serve(notes, embedder)
    fake.offload_gib, fake.root = 2.0, str(write_test_model(tmp_path / "llama8b", shape="llama-3.1-8b"))
    host = 2 * (1 << 30) // LLAMA_8B_TOKEN_BYTES
    with server:
        server.wait_ready()
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        tiers = {s.labels["tier"]: s.value for family in text_string_to_metric_families(metrics)
                 for s in family.samples if s.name == "prefixrag_vllm_kv_cache_tokens"}
        assert tiers == {"gpu": 1_000_000, "host": host}
        budget = httpx.get(server.url + "/readyz", timeout=10).json()["warmup"]["token_budget"]
        assert budget == int((1_000_000 + host) * 0.8)  # the default kv_share, of both tiers
