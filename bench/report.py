"""``python -m bench.report RESULT.json...``: the markdown table of the READMEs for each benchmark result file
(``bench.prefix_cache`` or ``bench.replay``), with the exact command that produced it (rebuilt from the file's
recorded config); for any other benchmark's file, its recorded command and its figures."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

COLUMNS = ("mode", "k", "hit rate", "ceiling", "mean prompt tok", "mean uncached tok", "TTFT p50 ms", "p95 ms",
           "e2e p50 ms", "overhead p50 ms", "q/s", "recall", "warm-up s")


def command(config: dict) -> str:
    argv = ["python", "-m", "bench.prefix_cache"]
    for key in ("data", "questions", "concurrency", "top_k", "seed", "max_tokens", "modes"):
        argv += [f"--{key.replace('_', '-')}", str(config[key])]
    argv += ["--start-vllm", "--max-model-len", str(config["max_model_len"])] if config.get("start_vllm") else \
        ["--vllm-url", "URL"]
    if config.get("chroma_path"):  # a reused collection (ingest skips unchanged files): same results, less time
        argv += ["--chroma-path", config["chroma_path"]]
    return shlex.join(argv + ["--out", config["out"]])


def row(r: dict) -> str:
    recall = f"{r['recall']:.3f}" if r.get("recall") is not None else "–"
    cells = [f"`{r['mode']}`" + (f" ({r['strategy']})" if r["mode"] in ("auto", "prefixrag") else ""), r["k"],
             f"{r['hit_rate']:.3f}", f"{r['ceiling']:.3f}", f"{r['mean_prompt_tokens']:.0f}",
             f"{r['mean_uncached_prompt_tokens']:.0f}", f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p95']:.0f}",
             f"{r['e2e_ms']['p50']:.0f}", f"{r['overhead_ms']['p50']:.0f}", f"{r['throughput_qps']:.2f}", recall,
             f"{r['warmup_s']:.1f}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def report(path: Path) -> str:
    data = json.loads(path.read_text())
    if "server" in data:
        return replay_report(data)
    if "results" not in data or "question_ids" not in data or "command" in data:  # not bench.prefix_cache's
        return figures_report(path, data)
    config, env = data["config"], data.get("environment", {})
    where = f", on {env['gpu']}, vLLM {env.get('packages', {}).get('vllm')}" if env.get("gpu") else ""
    lines = [f"**{data['dataset']}, {len(data['question_ids'])} shuffled questions, concurrency "
             f"{config['concurrency']}, top-k {config['top_k']}{where}** — `{command(config)}`", "",
             "| " + " | ".join(COLUMNS) + " |", "| --- |" + " ---: |" * (len(COLUMNS) - 1)]
    lines += [row(r) for r in data["results"]]
    for skipped in data.get("skipped", []):
        lines += ["", f"`{skipped['mode']}` skipped: {skipped['skipped']} ({skipped.get('corpus_tokens')} tokens)."]
    return "\n".join(lines)


REPLAY_COLUMNS = ("mode", "concurrency", "hit rate", "ceiling", "mean prompt tok", "mean cached tok", "TTFT p50 ms",
                  "p95 ms", "p99 ms", "vLLM TTFT mean ms", "vLLM queue mean ms", "q/s", "errors")


def replay_command(config: dict) -> str:
    argv = ["python", "-m", "bench.replay", "--prompts", config["prompts"], "--vllm-url", "URL",
            "--concurrency", ",".join(map(str, config["concurrency"]))]
    for key in ("modes", "label"):
        if config.get(key):
            argv += [f"--{key}", config[key]]
    return shlex.join(argv + ["--out", config["out"]])


def replay_row(r: dict) -> str:
    server = r.get("server_ms", {})
    def fmt(v):
        return "–" if v is None else f"{v:.1f}"
    cells = [f"`{r['mode']}`", r["concurrency"], f"{r['hit_rate']:.3f}", f"{r['ceiling']:.3f}",
             f"{r['mean_prompt_tokens']:.0f}", f"{r['mean_cached_tokens']:.0f}", f"{r['ttft_ms']['p50']:.1f}",
             f"{r['ttft_ms']['p95']:.1f}", f"{r['ttft_ms']['p99']:.1f}", fmt(server.get("ttft_mean_ms")),
             fmt(server.get("queue_mean_ms")), f"{r['throughput_qps']:.1f}", r["errors"]]
    return "| " + " | ".join(map(str, cells)) + " |"


def replay_report(data: dict) -> str:
    server, env = data["server"], data["environment"]
    lines = [f"**{data['config'].get('label') or data['config']['prompts']}: replay on {env.get('gpu') or 'CPU'}, "
             f"vLLM {server.get('vllm_version')}, block {server['block_size']}** — `{replay_command(data['config'])}`",
             "", "| " + " | ".join(REPLAY_COLUMNS) + " |", "| --- |" + " ---: |" * (len(REPLAY_COLUMNS) - 1)]
    return "\n".join(lines + [replay_row(r) for r in data["results"]])


def figures_report(path: Path, data: dict) -> str:
    """Another benchmark's file (ingest, live traffic, scale-out, ...): its command and every figure in it, one
    row each (a list of more than a dozen rows shows as its length: the rows themselves are in the JSON)."""
    command = data.get("command") or "command not recorded in this file: see bench/README.md"
    lines = [f"**{path.name}** — `{command}`", "", "| figure | value |", "| --- | --- |"]
    return "\n".join(lines + [f"| {key} | {cell(value)} |" for key, value in figures(data)])


def cell(value: object, limit: int = 160) -> str:
    """One table cell: a long or multi-line text (a tool's printed summary) shortened to one line."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def figures(data: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for key, value in data.items():
        name = prefix + str(key)
        if name in ("command", "environment"):
            continue
        if isinstance(value, dict):
            rows += figures(value, name + ".")
        elif isinstance(value, list) and len(value) <= 12 and all(isinstance(item, dict) for item in value):
            rows += figures({f"[{i}]": item for i, item in enumerate(value)}, name)
        else:
            rows.append((name, f"{len(value)} rows" if isinstance(value, list) else value))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__)
    parser.add_argument("results", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print("\n\n".join(report(path) for path in args.results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
