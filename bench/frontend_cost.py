"""``python -m bench.frontend_cost --vllm-url URL``: what vLLM's API server spends rendering and tokenizing a chat
before the engine sees it, by prompt length. The same prompt, already in the prefix cache, is sent as a chat
(``/v1/chat/completions``: the server renders the template and tokenizes) and as its token ids
(``/v1/completions``: it does neither), one token each; the difference of the medians is the front end's cost.
Then both again through the app's own vLLM client, as token-id prompts send them (``app.vllm.prompt_ids``). Where
vLLM runs on this machine, last, the CPU time each of its processes spends per token-id request: what a long
prompt costs vLLM's own processes even when all of it is cached."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import command_line, environment, write_json

QUESTION = "What was the change in total revenue between the two years?"


def passages_text(path: Path, chars: int) -> str:
    """Enough passage text (jsonl ``text`` fields, in file order) for the largest prompt."""
    parts, total = [], 0
    with path.open() as lines:
        for line in lines:
            text = json.loads(line).get("text", "")
            parts.append(text)
            total += len(text)
            if total >= chars:
                break
    return "\n\n".join(parts)


def timed_ms(client: httpx.Client, path: str, body: dict) -> float:
    started = time.perf_counter()
    client.post(path, json=body).raise_for_status()
    return (time.perf_counter() - started) * 1000


async def via_app(url: str, model: str, messages: list[dict], ids: list[int], repeats: int) -> dict[str, list[float]]:
    """The same two ways through the app's own vLLM client (what token-id prompts use), streamed."""
    from app.core.settings import VLLMSettings
    from app.vllm.client import LLMClient
    from app.vllm.prompt_pieces import TokenPrompt
    from app.vllm.wire import Completion

    llm = LLMClient(VLLMSettings(url=url + "/v1"))
    llm.use_model(model)
    request = llm.chat_request(messages, max_tokens=1, temperature=0.0, prefix_key="frontend-cost")

    async def once(prompt_ids: TokenPrompt | None) -> float:
        started = time.perf_counter()
        async for _ in llm.stream_chat(request, Completion(), prompt_ids):
            pass
        return (time.perf_counter() - started) * 1000

    timings: dict[str, list[float]] = {"app_chat": [], "app_token_ids": []}
    for _ in range(repeats):
        timings["app_chat"].append(await once(None))
        timings["app_token_ids"].append(await once(TokenPrompt(TokenPrompt.open_array(ids), [])))
    await llm.aclose()
    return timings


def vllm_processes(url: str) -> dict[str, Any]:
    """vLLM's processes on this machine, by role: the one listening on ``url``'s port (the API server) and its
    descendants by process title (``VLLM::EngineCore``, ``VLLM::Worker``...); empty where vLLM runs elsewhere."""
    import psutil

    port = httpx.URL(url).port
    listening = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid
                 and c.status == psutil.CONN_LISTEN]
    if not listening:
        return {}
    server = psutil.Process(listening[0])
    found: dict[str, Any] = {"api_server": server}
    for child in server.children(recursive=True):
        title = (child.cmdline() or [child.name()])[0]
        if title.startswith("VLLM::"):
            found.setdefault(title, child)
    return found


def cpu_ms_per_request(client: httpx.Client, body: dict, processes: dict[str, Any], repeats: int) -> dict[str, float]:
    """CPU time (all threads, to the nanosecond: the kernel's schedstat, not its 10 ms ticks) each of vLLM's
    processes spends per token-id request, ``repeats`` in a row. A worker that spins while it waits counts that
    wait too."""
    def cpu_s() -> dict[str, float]:
        return {role: sum(int(task.read_text().split()[0]) for task in Path(f"/proc/{process.pid}/task").glob(
            "*/schedstat")) / 1e9 for role, process in processes.items()}

    before = cpu_s()
    for _ in range(repeats):
        client.post("/v1/completions", json=body).raise_for_status()
    after = cpu_s()
    return {role: round((after[role] - before[role]) / repeats * 1000, 2) for role in processes}


def measure(client: httpx.Client, model: str, text: str, tokens: int, repeats: int,
            processes: dict[str, Any] | None = None) -> dict:
    messages = [{"role": "system", "content": text[:tokens * 4]}, {"role": "user", "content": QUESTION}]
    ids = client.post("/tokenize", json={"model": model, "messages": messages}).json()["tokens"]
    chat = {"model": model, "messages": messages, "max_tokens": 1}
    ids_only = {"model": model, "prompt": ids, "max_tokens": 1}
    timed_ms(client, "/v1/chat/completions", chat)  # into the prefix cache
    timings: dict[str, list[float]] = {"chat": [], "token_ids": [], "tokenize": []}
    for _ in range(repeats):  # interleaved, so drift in the server's load hits all three alike
        timings["chat"].append(timed_ms(client, "/v1/chat/completions", chat))
        timings["token_ids"].append(timed_ms(client, "/v1/completions", ids_only))
        timings["tokenize"].append(timed_ms(client, "/tokenize", {"model": model, "messages": messages}))
    timings |= asyncio.run(via_app(str(client.base_url).rstrip("/"), model, messages, ids, repeats))
    medians = {name: round(statistics.median(values), 2) for name, values in timings.items()}
    row = {"prompt_tokens": len(ids), "median_ms": medians,
           "front_end_ms": round(medians["chat"] - medians["token_ids"], 2),
           "saved_through_the_app_ms": round(medians["app_chat"] - medians["app_token_ids"], 2)}
    if processes:
        row["token_ids_cpu_ms_per_request"] = cpu_ms_per_request(client, ids_only, processes, repeats)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.frontend_cost", description=__doc__)
    parser.add_argument("--vllm-url", default="http://127.0.0.1:8000", help="vLLM server (no /v1)")
    parser.add_argument("--passages", type=Path, default=Path("../shared/data/tatqa/passages.jsonl"),
                        help="a jsonl of passages whose text fills the prompts")
    parser.add_argument("--tokens", default="450,3800,16000", help="prompt sizes to measure (approximate tokens)")
    parser.add_argument("--repeats", type=int, default=40, help="requests per size and way")
    parser.add_argument("--out", type=Path, default=Path("bench/results/frontend-cost.json"))
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.tokens.split(",")]
    text = passages_text(args.passages, max(sizes) * 4)
    with httpx.Client(base_url=args.vllm_url.rstrip("/"), timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        processes = vllm_processes(args.vllm_url)
        rows = [measure(client, model, text, size, args.repeats, processes) for size in sizes]
    for row in rows:
        print(json.dumps(row), flush=True)
    payload = {"command": command_line("bench.frontend_cost", argv), "model": model,
               "repeats": args.repeats, "rows": rows, "environment": environment()}
    write_json(args.out, payload)
    try:
        plot(payload, args.out.with_suffix(".png"))
    except ImportError:  # matplotlib is optional where it runs (the GPU image); the JSON holds every figure
        print("matplotlib not available: no plot written")
    return 0


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["prompt_tokens"] for row in payload["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for way, label in (("chat", "chat (rendered + tokenized by vLLM)"), ("token_ids", "the same as token ids"),
                       ("tokenize", "/tokenize alone"), ("app_chat", "chat, through the app's client"),
                       ("app_token_ids", "token ids, through the app's client")):
        if all(way in row["median_ms"] for row in payload["rows"]):
            ax.plot(tokens, [row["median_ms"][way] for row in payload["rows"]], marker="o", label=label)
    ax.set(xlabel="prompt tokens (all cached but the last block)", ylabel="median ms, 1 output token",
           title=f"vLLM front-end cost on {payload['environment'].get('gpu') or 'CPU'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
