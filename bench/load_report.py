"""``bench.throughput``'s figures: per arm, what its clients saw; what the app spent (its stages, its CPU);
what vLLM's own histograms say over the arm; the plot and the one-line summary."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from app.vllm.prometheus import metric_total
from bench.stats import percentile

APP_ENV_DEFAULTS: dict[str, str] = {}  # prefixrag is measured with its defaults: nothing beyond what a user sets
HISTOGRAMS = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
              "prefill": "vllm:request_prefill_time_seconds", "e2e": "vllm:e2e_request_latency_seconds"}
STAGES = ("admit", "retrieve", "assemble", "prepare", "upstream_ttft", "ttft")
# The app's own histograms (its /metrics), by what the row calls them, and the label that splits one.
APP_HISTOGRAMS = {"admission_wait": ("prefixrag_admission_wait_seconds", None),
                  "ranking": ("prefixrag_retrieval_stage_seconds", "stage"),
                  "loop_lag": ("prefixrag_event_loop_lag_seconds", None),
                  "gc_pause": ("prefixrag_gc_pause_seconds", "generation")}


def ms(values: list[float]) -> dict[str, float]:
    return {f"p{q}": round(percentile(values, q), 1) for q in (50, 95, 99)}


def sample_stats(samples: list, wall_s: float) -> dict:
    ok = [s for s in samples if s.status == 200]
    statuses: dict[str, int] = {}
    for s in samples:
        statuses[str(s.status)] = statuses.get(str(s.status), 0) + 1
    row = {"requests": len(samples), "answers": len(ok), "statuses": statuses, "wall_s": round(wall_s, 2),
           "answers_per_s": round(len(ok) / wall_s, 2) if wall_s else 0.0,
           "ttft_ms": ms([s.ttft_s * 1000 for s in ok]), "e2e_ms": ms([s.e2e_s * 1000 for s in ok]),
           "errors": sorted({s.error for s in samples if s.error})[:3],
           "refused_before_admitted": sum(s.refused for s in samples),
           "waited_s_p50": round(percentile([s.waited_s for s in samples], 50), 2)}
    timed = [s for s in ok if s.server_ms]
    if timed:  # the app's own stages, and what lies outside vLLM as this client saw it
        row["app_ms"] = {stage: ms([s.server_ms[stage] for s in timed]) for stage in STAGES
                         if stage in timed[0].server_ms}  # an app older than a stage does not report it
        row["outside_vllm_ms"] = ms([s.ttft_s * 1000 - s.server_ms["upstream_ttft"] for s in timed])
        row["relay_ms"] = ms([s.ttft_s * 1000 - s.server_ms["ttft"] for s in timed])
    return row


def engine_figures(before: dict[str, str], after: dict[str, str]) -> dict:
    """vLLM's mean queue, prefill, TTFT and end-to-end time (ms) and its prefix-cache hit rate over the arm,
    from its own counters (summed over the servers behind the URL)."""
    def delta(name: str) -> float:
        return sum(metric_total(after[s], name) - metric_total(before.get(s, ""), name) for s in after)

    means = {}
    for key, name in HISTOGRAMS.items():
        count = delta(name + "_count")
        means[key] = round(delta(name + "_sum") / count * 1000, 1) if count else None
    queries = delta("vllm:prefix_cache_queries_total")
    return {"vllm_mean_ms": means, "vllm_requests": delta("vllm:request_success_total"),
            "vllm_hit_rate": round(delta("vllm:prefix_cache_hits_total") / queries, 4) if queries else None}


def app_figures(before: str, after: str) -> dict:
    """The app's own histograms over the arm, from its /metrics before and after: per histogram (and per label
    where one splits it) the mean in ms and the count: the admission wait, a ranking's stages in the workers,
    the event loop's lag, GC pauses; and the prompts sent, by form (token ids or chats)."""
    start, end = _histogram_sums(before), _histogram_sums(after)
    sent, sent_before = _prompts_by_form(after), _prompts_by_form(before)
    figures: dict = {"prompts": {form: int(n - sent_before.get(form, 0)) for form, n in sent.items()}}
    for key, (name, label) in APP_HISTOGRAMS.items():
        for (found, part), (total, count) in end.items():
            total -= start.get((found, part), (0.0, 0.0))[0]
            count -= start.get((found, part), (0.0, 0.0))[1]
            if found == name and count:
                entry = {"mean_ms": round(total / count * 1000, 2), "count": int(count)}
                figures.setdefault(key, {}).update({part: entry} if label else entry)
    return figures


def _prompts_by_form(text: str) -> dict[str, float]:
    return {sample.labels["form"]: sample.value for family in text_string_to_metric_families(text)
            if family.name == "prefixrag_prompts" for sample in family.samples if sample.name.endswith("_total")}


def _histogram_sums(text: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(histogram, its one label's value) -> (sum, count), for every histogram in a Prometheus text."""
    sums: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        for sample in family.samples:
            if sample.name in (family.name + "_sum", family.name + "_count"):
                part = next(iter(sample.labels.values()), "")
                sums.setdefault((family.name, part), [0.0, 0.0])[sample.name.endswith("_count")] += sample.value
    return {key: (total, count) for key, (total, count) in sums.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it (an app with several workers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            total += (int(stats[current][11]) + int(stats[current][12])) / ticks
        todo += children.get(current, [])
    return total


def host_cpu_seconds() -> tuple[float, float]:
    """The whole machine's busy and stolen CPU seconds so far (``/proc/stat``, all cores): busy over a cell's
    wall time is how many cores everything on the host kept busy (vLLM's processes, the app, the clients);
    stolen, how much the hypervisor gave to others."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    ticks = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / ticks, steal / ticks


def loop_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid``'s main thread alone: the app's event loop, which every request and
    every relayed token of the serving process passes through (busy for the whole arm: it sets the pace)."""
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(result: dict) -> str:
    lines = [f"{'arm':<10} {'c':>4} {'tok':>4} {'stream':>6} {'ans/s':>7} {'TTFT p50':>9} {'p99':>7} {'outside':>8}"]
    for r in result["results"]:
        outside = r.get("outside_vllm_ms", {}).get("p50", "")
        lines.append(f"{r['arm']:<10} {r['concurrency']:>4} {r['max_tokens']:>4} {str(r['streamed']):>6} "
                     f"{r['answers_per_s']:>7} {r['ttft_ms']['p50']:>9} {r['ttft_ms']['p99']:>7} {outside:>8}")
    return "\n".join(lines)


def plot_throughput(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple, list[dict]] = {}
    for r in result["results"]:
        series.setdefault((r["arm"], r["max_tokens"], r["streamed"]), []).append(r)
    for (arm, tokens, streamed), rows in series.items():
        label = f"{arm}, {tokens} tok{'' if streamed else ', not streamed'}"
        xs = [r["concurrency"] for r in rows]
        rate.plot(xs, [r["answers_per_s"] for r in rows], marker="o", label=label)
        ttft.plot(xs, [r["ttft_ms"]["p50"] for r in rows], marker="o", label=label)
    for axis, title in ((rate, "answers / s"), (ttft, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("concurrent clients")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    ttft.legend(fontsize=7)
    figure.suptitle(f"{result['dataset']}: {result['environment'].get('gpu') or 'CPU'}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
