"""``python -m app.vllm_server`` builds the command prefixrag relies on, per backend; ``app.vllm.testmodel`` writes
models of the shapes the benchmarks use. (The CPU command itself is exercised by every vLLM test.)"""

from __future__ import annotations

import json
import subprocess
import sys

from app.core.settings import VLLMServerSettings
from app.vllm.launcher import build_command, cpu_dtype
from app.vllm.testmodel import write_test_model
from tests.support.env import ROOT


def flags(argv: list[str]) -> dict[str, str | None]:
    """``--name value`` pairs (a bare flag maps to None)."""
    out, index = {}, 0
    while index < len(argv):
        if argv[index].startswith("--"):
            value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
            out[argv[index]] = value
            index += 2 if value is not None else 1
        else:
            index += 1
    return out


def test_cpu_gets_our_small_batches_and_eager_mode_gpu_gets_vllms_defaults_and_cuda_graphs(tmp_path):
    model = write_test_model(tmp_path / "llama8b", shape="llama-3.1-8b")
    cfg = VLLMServerSettings(model=str(model), load_format="dummy", block_size=16, dev_mode=True)
    cpu_argv, cpu_env = build_command(cfg, gpu=False)
    gpu_argv, gpu_env = build_command(cfg, gpu=True)
    cpu, gpu = flags(cpu_argv), flags(gpu_argv)
    for both in (cpu, gpu):
        assert {"--enable-prefix-caching", "--enable-chunked-prefill", "--enable-prompt-tokens-details"} <= set(both)
        assert both["--load-format"] == "dummy" and both["--block-size"] == "16"
    assert cpu["--max-num-batched-tokens"] == "2048" and cpu["--max-num-seqs"] == "16" and "--enforce-eager" in cpu
    assert not {"--max-num-batched-tokens", "--max-num-seqs", "--enforce-eager"} & set(gpu)
    assert gpu["--gpu-memory-utilization"] == "0.9" and "VLLM_CPU_KVCACHE_SPACE" not in gpu_env
    assert cpu_env["VLLM_CPU_KVCACHE_SPACE"] and gpu_env["VLLM_SERVER_DEV_MODE"] == "1"
    assert gpu_env["HF_HUB_OFFLINE"] == "1"  # a local folder never sends vLLM to the Hub
    explicit = VLLMServerSettings(model=str(model), enforce_eager=False, max_num_seqs=64)
    assert "--enforce-eager" not in build_command(explicit, gpu=False)[0]
    assert flags(build_command(explicit, gpu=True)[0])["--max-num-seqs"] == "64"


def test_the_8b_shape_is_llama_3_1_8b_with_the_test_tokenizer(tmp_path):
    folder = write_test_model(tmp_path / "m", max_position_embeddings=32768, shape="llama-3.1-8b")
    config = json.loads((folder / "config.json").read_text())
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"],
            config["num_attention_heads"], config["num_key_value_heads"]) == (4096, 14336, 32, 32, 8)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    assert config["vocab_size"] >= len(vocab) and json.loads((folder / "tokenizer_config.json").read_text())[
        "chat_template"]


def test_launcher_cli_prints_the_command_and_has_help(tmp_path):
    shown = subprocess.run([sys.executable, "-m", "app.vllm_server", "--model", str(tmp_path), "--load-format",
                            "dummy", "--block-size", "16", "--dry-run"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "--load-format dummy" in shown.stdout and "--block-size 16" in shown.stdout
    for module in ("app.vllm_server", "app.testmodel"):
        helped = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert helped.returncode == 0 and "usage:" in helped.stdout


def test_a_kv_cache_size_the_user_exported_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "9")
    _, env = build_command(VLLMServerSettings(model=str(tmp_path)), gpu=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # not overridden: the child inherits the user's 9
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_cpu_without_native_bf16_serves_float32_unless_a_dtype_was_chosen(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert cpu_dtype("auto", {"avx2", "fma"}) == "float32"  # oneDNN has no bf16 matmul here: emulated, 3x slower
    assert cpu_dtype("auto", {"avx2", "avx512f", "avx512_bf16"}) == "auto"
    assert cpu_dtype("auto", {"avx2", "amx_bf16"}) == "auto"
    assert cpu_dtype("bfloat16", {"avx2"}) == "bfloat16"  # the user's choice stands
    monkeypatch.setattr("app.vllm.launcher.cpu_flags", lambda: {"avx2"})
    cfg = VLLMServerSettings(model=str(tmp_path))
    assert flags(build_command(cfg, gpu=False)[0])["--dtype"] == "float32"
    assert flags(build_command(cfg, gpu=True)[0])["--dtype"] == "auto"


def test_a_model_folder_given_by_a_relative_path_is_served_by_its_absolute_one(tmp_path, monkeypatch):
    """vLLM reports the folder it was given as the model's root, where the query service looks for the tokenizer
    its token-id prompts need: a relative one meant nothing to a service started from another directory."""
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    served = flags(build_command(VLLMServerSettings(model="models/mine"), gpu=True)[0])
    assert (served["--model"], served["--served-model-name"]) == (str(tmp_path / "models" / "mine"), "models/mine")
    by_id = flags(build_command(VLLMServerSettings(model="org/some-model"), gpu=True)[0])  # a hub id: as given
    assert by_id["--model"] == "org/some-model"
