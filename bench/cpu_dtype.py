"""``python -m bench.cpu_dtype``: what vLLM's CPU backend pays for each dtype on this machine. For each model and
dtype, vLLM is started through the project's launcher (``PREFIXRAG_VLLM_SERVER__DTYPE``), then uncached prompts of
about ``--words`` words are sent to ``/v1/completions`` with one output token, each different from its first
word on so nothing is served from the prefix cache; the median is prefill's cost. ``auto`` is what the launcher
chooses here (README, "Serving vLLM": float32 on an x86 CPU without native bf16)."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.common import command_line, environment, write_json

MODELS = {"test-model": ["--test-model"], "smollm2": ["--model", "smollm2"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cpu_dtype", description=__doc__)
    parser.add_argument("--models", default="test-model,smollm2", help="test-model and/or smollm2")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="vLLM --dtype values, comma-separated")
    parser.add_argument("--words", type=int, default=1400, help="prompt length in words (default 1400)")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per model and dtype (default 3)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/cpu-dtype.json"))
    return parser.parse_args(argv)


def prefill_ms(url: str, words: int, repeats: int) -> tuple[int, list[float]]:
    """(prompt tokens, milliseconds per uncached prompt)."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    text = " ".join(f"word{i} lorem ipsum" for i in range(words // 3))
    tokens, timings = 0, []
    for n in range(repeats):
        started = time.perf_counter()
        response = httpx.post(url + "/v1/completions", timeout=600,
                              json={"model": model, "prompt": f"{n} {text}", "max_tokens": 1})
        timings.append(round((time.perf_counter() - started) * 1000, 1))
        tokens = response.json()["usage"]["prompt_tokens"]
    return tokens, timings


def measure(model: str, dtype: str, args: argparse.Namespace, tmp: Path) -> dict:
    from app.vllm.process import Child, free_port, vllm_argv

    port = free_port()
    log = tmp / f"vllm-{model}-{dtype}.log"
    child = Child("vLLM", vllm_argv(port, *MODELS[model]), log, {"PREFIXRAG_VLLM_SERVER__DTYPE": dtype})
    child.start().wait_for(f"http://127.0.0.1:{port}/v1/models", 600)
    try:
        tokens, timings = prefill_ms(f"http://127.0.0.1:{port}", args.words, args.repeats)
    finally:
        child.stop()
    started = log.read_text()
    return {"model": model, "dtype": dtype, "prompt_tokens": tokens, "ms": timings,
            "median_ms": statistics.median(timings),
            "emulated": "fallback to torch linear" in started}  # vLLM's log: oneDNN had no kernel for it


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-dtype-") as tmp:
        rows = [measure(model, dtype, args, Path(tmp))
                for model in args.models.split(",") for dtype in args.dtypes.split(",")]
    for row in rows:
        print(row, flush=True)
    payload = {"command": command_line("bench.cpu_dtype", argv), "rows": rows, "environment": environment()}
    write_json(args.out, payload)
    plot(payload, args.out.with_suffix(".png"))
    return 0


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['model']}\n{r['dtype']}{' (emulated)' if r['emulated'] else ''}" for r in rows]
    ax.bar(labels, [r["median_ms"] / 1000 for r in rows])
    ax.set(ylabel="seconds, one uncached prompt (median)",
           title=f"vLLM CPU prefill by dtype ({rows[0]['prompt_tokens']}+ tokens)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
