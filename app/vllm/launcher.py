"""``python -m app.vllm_server``: start vLLM's OpenAI server with the flags prefixrag relies on.

Prefix caching and chunked prefill are always on, ``--enable-prompt-tokens-details`` makes every response
report ``cached_tokens``, and priority scheduling lets pre-warm queue behind users. The exact command is printed
before it runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
from pathlib import Path

from app.core.devices import has_cuda
from app.core.settings import Settings, UnknownSetting, VLLMServerSettings, invalid_setting, overridden
from app.core.version import add_version
from app.vllm.entry import PRIME_ENV

TEST_MODEL_NAME = "prefixrag-test-model"


def resolve_model(cfg: VLLMServerSettings) -> tuple[str, str, list[str]]:
    """Return (model path or id, served name, extra flags) for the configured model."""
    if cfg.test_model:
        from app.vllm.testmodel import write_test_model

        folder = write_test_model(cfg.cache_dir.resolve() / "test-model", max(cfg.max_model_len, 32768))
        return str(folder), cfg.served_model_name or TEST_MODEL_NAME, ["--load-format", "dummy"]
    if cfg.model == "smollm2":
        from app.vllm.smollm2 import convert_smollm2

        folder = convert_smollm2(cfg.cache_dir.resolve() / "smollm2-135m-instruct")
        return str(folder), cfg.served_model_name or "SmolLM2-135M-Instruct", []
    if not cfg.model:
        raise SystemExit("error: no model: set PREFIXRAG_VLLM_SERVER__MODEL, pass --model, or use --test-model")
    # A folder by its absolute path: vLLM reports it as the model's root, where the query service, started from
    # any directory, finds the tokenizer its token-id prompts need (a relative one turned them off silently).
    model = str(Path(cfg.model).resolve()) if Path(cfg.model).is_dir() else cfg.model
    return model, cfg.served_model_name or cfg.model, []


def cpu_flags() -> set[str]:
    """This CPU's feature flags (x86 Linux; empty elsewhere)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


def cpu_dtype(requested: str, flags: set[str] | None = None) -> str:
    """The CPU backend's dtype: ``auto`` becomes float32 on an x86 CPU without native bf16 (AVX2-only, e.g.
    many AMD EPYC VMs). vLLM takes bf16 from the model's config, oneDNN cannot build a bf16 matmul there, and
    vLLM falls back to torch's emulated bf16, several times slower than float32 (docs/operations.md)."""
    if requested != "auto" or platform.machine() not in ("x86_64", "AMD64"):
        return requested
    flags = cpu_flags() if flags is None else flags
    return "auto" if not flags or flags & {"avx512_bf16", "amx_bf16"} else "float32"


def offload_gib(requested: float | str, meminfo: str = "/proc/meminfo") -> float:
    """The host KV tier's size: as given, or for 'auto' half the memory the host has available now (GiB)."""
    if requested != "auto":
        return float(requested)
    with open(meminfo) as info:
        kib = next(int(line.split()[1]) for line in info if line.startswith("MemAvailable:"))
    return round(kib / (1 << 20) / 2, 1)


# The CPU backend's defaults are ours (measured on 2 cores); on a GPU vLLM's own defaults fit the device better.
CPU_DEFAULTS = {"max_num_batched_tokens": 2048, "max_num_seqs": 16, "enforce_eager": True}


def build_command(cfg: VLLMServerSettings, gpu: bool) -> tuple[list[str], dict[str, str]]:
    model, served_name, model_flags = resolve_model(cfg)
    if cfg.load_format and "--load-format" not in model_flags:
        model_flags += ["--load-format", cfg.load_format]
    # No phoning home; and a model we wrote to a local folder must never make vLLM reach for the Hub.
    quiet = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cfg.test_model or cfg.model == "smollm2" or Path(model).is_dir():
        quiet |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    argv = [
        sys.executable, "-m", "app.vllm.entry",  # vLLM's OpenAI server, detokenizer priming bounded
        "--model", model, "--served-model-name", served_name, "--host", cfg.host, "--port", str(cfg.port),
        "--max-model-len", str(cfg.max_model_len), "--enable-prefix-caching", "--enable-chunked-prefill",
        "--dtype", cfg.dtype if gpu else cpu_dtype(cfg.dtype), "--enable-prompt-tokens-details",
        "--enable-tokenizer-info-endpoint",  # the service reads the special tokens to keep out of documents
        "--scheduling-policy", "priority",  # pre-warm is sent at a lower priority than users' requests
        *model_flags,
    ]
    defaults = {} if gpu else CPU_DEFAULTS
    for field in ("max_num_batched_tokens", "max_num_seqs", "block_size"):
        value = getattr(cfg, field) or defaults.get(field)
        if value:
            argv += [f"--{field.replace('_', '-')}", str(value)]
    if cfg.api_server_count > 1:
        argv += ["--api-server-count", str(cfg.api_server_count)]
    if cfg.quantization:
        argv += ["--quantization", cfg.quantization]
    if cfg.enforce_eager if cfg.enforce_eager is not None else defaults.get("enforce_eager", False):
        argv += ["--enforce-eager"]
    env = quiet | ({"VLLM_SERVER_DEV_MODE": "1"} if cfg.dev_mode else {})
    env[PRIME_ENV] = str(cfg.detokenizer_prime_tokens)
    if gpu:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
                 "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        if cfg.kv_offload_gib:
            argv += ["--kv-offloading-backend", "native", "--kv-offloading-size", str(offload_gib(cfg.kv_offload_gib))]
    else:
        # CPU backend: KV cache size is set in GiB; on small machines reserving no core halves prefill time.
        # A value the user exported wins over ours.
        env |= {k: v for k, v in {"VLLM_CPU_KVCACHE_SPACE": str(cfg.cpu_kvcache_space_gib),
                                  "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}.items() if k not in os.environ}
    return argv + list(cfg.extra_args), env


def parse_args(argv: list[str] | None) -> tuple[VLLMServerSettings, bool]:
    settings = Settings()
    cfg = settings.vllm_server
    parser = argparse.ArgumentParser(prog="python -m app.vllm_server", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF id or folder; 'smollm2' converts the packaged SmolLM2-135M-Instruct")
    parser.add_argument("--test-model", action="store_true", help="serve the tiny dummy-weight test model")
    parser.add_argument("--port", type=int, help=f"port (default {cfg.port})")
    parser.add_argument("--host", help=f"bind address (default {cfg.host})")
    parser.add_argument("--max-model-len", type=int, help=f"context window (default {cfg.max_model_len})")
    parser.add_argument("--load-format", help="vLLM --load-format ('dummy': random weights, real shape)")
    parser.add_argument("--block-size", type=int, help="KV block size in tokens (default: the backend's)")
    parser.add_argument("--api-server-count", type=int, help="vLLM front-end processes (default 1)")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help=f"share of GPU memory vLLM may take (default {cfg.gpu_memory_utilization})")
    parser.add_argument("--kv-offload-gib", type=lambda v: v if v == "auto" else float(v),
                        help="GPU only: keep evicted KV blocks in this many GiB of host memory ('auto': half "
                        "of what is available; default off)")
    parser.add_argument("--dev-mode", action="store_true", help="enable /reset_prefix_cache (benchmarks)")
    parser.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: passed to vLLM verbatim")
    args = add_version(parser).parse_args(argv)
    flags = {f"vllm_server.{k}": v for k, v in vars(args).items() if v is not False and k not in ("extra", "dry_run")}
    if args.extra:
        flags["vllm_server.extra_args"] = [a for a in args.extra if a != "--"]
    return overridden(settings, flags).vllm_server, args.dry_run


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    try:
        cfg, dry_run = parse_args(argv)
    except (ValidationError, UnknownSetting) as exc:
        print(f"error: {invalid_setting(exc)}", file=sys.stderr)
        return 2
    gpu = has_cuda()
    if cfg.kv_offload_gib and not gpu:  # the CPU backend's KV cache is host memory already
        print("error: --kv-offload-gib needs a GPU: vLLM's KV offloading moves GPU blocks to host memory",
              file=sys.stderr)
        return 2
    argv_vllm, env = build_command(cfg, gpu=gpu)
    nice = 0 if gpu else cfg.cpu_nice
    printable = " ".join(f"{k}={v}" for k, v in env.items()) + " " + shlex.join(argv_vllm)
    print(f"[prefixrag] starting vLLM{f' (nice +{nice})' if nice else ''}: {printable.strip()}", flush=True)
    if dry_run:
        return 0
    if nice:
        os.nice(nice)
    os.execvpe(argv_vllm[0], argv_vllm, os.environ | env)


if __name__ == "__main__":
    sys.exit(main())
