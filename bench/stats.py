"""Aggregate per-request records into the figures the benchmark reports; the table and the plot."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def gold_found(found: Iterable[Iterable[str]], questions: Iterable[Any]) -> float:
    """The share of ``questions`` (each with its ``gold`` document ids) whose gold is among the document ids
    ``found`` for it, in order (0.0 for none): the recall every benchmark reports."""
    pairs = list(zip(found, questions, strict=True))
    return sum(bool(q.gold & set(ids)) for ids, q in pairs) / len(pairs) if pairs else 0.0


def ms_summary(values: list[float], quantiles=(50, 95, 99)) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q) * 1000, 1) for q in quantiles}


def summarise(records, questions, hits: float, queries: float, wall_s: float, ceiling) -> dict:
    ok = [r for r in records if r.error is None]
    answerable = [(r, q) for r, q in zip(records, questions) if q.gold and r.error is None]
    recall = sum(bool(r.doc_ids & q.gold) for r, q in answerable) / len(answerable) if answerable else None
    def mean(xs):
        return round(statistics.fmean(xs), 1) if xs else 0.0
    return {
        "questions": len(records), "errors": len(records) - len(ok),
        "hit_rate": round(hits / queries, 4) if queries else 0.0, "hits": hits, "queries": queries,
        "ceiling": round(ceiling.hit_rate, 4), "ceiling_hit_tokens": ceiling.hit_tokens,
        "ceiling_query_tokens": ceiling.query_tokens,
        "mean_prompt_tokens": mean([r.prompt_tokens for r in ok]),
        "mean_cached_tokens": mean([r.cached_tokens for r in ok]),
        "mean_uncached_prompt_tokens": mean([r.prompt_tokens - r.cached_tokens for r in ok]),
        "ttft_ms": ms_summary([r.ttft_s for r in ok]), "e2e_ms": ms_summary([r.e2e_s for r in ok], (50,)),
        "overhead_ms": ms_summary([r.overhead_s for r in ok], (50, 95)),
        "throughput_qps": round(len(ok) / wall_s, 3) if wall_s else 0.0,
        "recall": round(recall, 4) if recall is not None else None, "recall_questions": len(answerable),
    }


def table(results: list[dict]) -> str:
    header = (f"{'mode':<16}{'k':>4}{'hit':>7}{'ceil':>7}{'prompt':>8}{'uncached':>9}{'ttft p50':>9}{'p95':>8}"
              f"{'recall':>8}")
    rows = [header, "-" * len(header)]
    for r in results:
        recall = f"{r['recall']:.3f}" if r["recall"] is not None else "-"
        rows.append(f"{r['mode']:<16}{r['k']:>4}{r['hit_rate']:>7.3f}{r['ceiling']:>7.3f}{r['mean_prompt_tokens']:>8.0f}"
                    f"{r['mean_uncached_prompt_tokens']:>9.0f}{r['ttft_ms']['p50']:>9.0f}{r['ttft_ms']['p95']:>8.0f}"
                    f"{recall:>8}")
    return "\n".join(rows)


def retrieval_table(retrieval: dict) -> str:
    """The retriever's own recall@k per retrieval mode (before any context strategy)."""
    ks = list(next(iter(retrieval.values())))
    rows = [f"{'retriever':<12}" + "".join(f"{k:>12}" for k in ks)]
    rows += [f"{mode:<12}" + "".join(f"{values[k] if values[k] is not None else '-':>12}" for k in ks)
             for mode, values in retrieval.items()]
    return "\n".join(rows)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [r["mode"] for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(modes, [r["hit_rate"] for r in results], color="#2e5bff", label="observed (vLLM counters)")
    left.scatter(modes, [r["ceiling"] for r in results], color="black", marker="_", s=600, label="ceiling")
    left.set_ylim(0, 1)
    left.set_ylabel("prefix cache hit rate (tokens)")
    left.legend(loc="upper left", fontsize=8)
    x = range(len(modes))
    right.bar([i - 0.2 for i in x], [r["ttft_ms"]["p50"] for r in results], width=0.4, label="TTFT p50")
    right.bar([i + 0.2 for i in x], [r["ttft_ms"]["p95"] for r in results], width=0.4, label="TTFT p95")
    right.set_xticks(list(x), modes)
    right.set_yscale("log")
    right.set_ylabel("ms")
    right.legend(fontsize=8)
    for axis in (left, right):
        axis.tick_params(axis="x", rotation=30)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_replay(results: list[dict], path: Path, title: str) -> None:
    """Hit rate per mode, and TTFT p50 per mode at each concurrency (``bench.replay``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r["mode"] for r in results))
    levels = sorted({r["concurrency"] for r in results})
    by = {(r["mode"], r["concurrency"]): r for r in results}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(levels)
    for i, level in enumerate(levels):
        xs = [m + (i - (len(levels) - 1) / 2) * width for m in range(len(modes))]
        left.bar(xs, [by[(m, level)]["hit_rate"] if (m, level) in by else 0 for m in modes], width=width,
                 label=f"c={level}")
        right.bar(xs, [by[(m, level)]["ttft_ms"]["p50"] if (m, level) in by else 0 for m in modes], width=width,
                  label=f"c={level}")
    left.set_ylim(0, 1)
    left.set_ylabel("prefix cache hit rate (tokens)")
    right.set_ylabel("TTFT p50 (ms)")
    for axis in (left, right):
        axis.set_xticks(range(len(modes)), modes)
        axis.tick_params(axis="x", rotation=30)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_live_traffic(result: dict, path: Path) -> None:
    """TTFT against time since the app started (during pre-warm, then after), and the overload latencies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for rows, label in ((result["during_warmup"], "during pre-warm"), (result["after_warmup"], "after pre-warm"),
                        (result.get("fresh_after_warmup", []), "never asked before, after pre-warm"),
                        (result["cold_idle"], "idle, cache reset")):
        left.plot([r["t_s"] for r in rows], [r["ttft_ms"] for r in rows], "o", label=label)
    left.axvline(result["ready_s"], color="grey", linestyle=":", label="/readyz 200")
    left.axvline(result["warmup_done_s"], color="black", linestyle="--", label="pre-warm done")
    left.set_xlabel("seconds since the app started")
    left.set_ylabel("TTFT (ms)")
    left.legend(fontsize=8)
    load, single = result["load"], result["single"]
    admitted = sorted(r["ms"] for r in load["requests"] if r["status"] == 200)
    alone = sorted(r["ms"] for r in single["requests"] if r["status"] == 200)
    for values, label in ((alone, "1 client"), (admitted, f"{load['clients']} clients (admitted)")):
        right.plot(values, [i / max(1, len(values) - 1) for i in range(len(values))], label=label)
    right.axvline(3 * single["p50_ms"], color="red", linestyle=":", label="3x single p50")
    right.set_xlabel("latency (ms)")
    right.set_ylabel("share of requests")
    right.legend(fontsize=8)
    fig.suptitle(f"live traffic first: {load['statuses']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
