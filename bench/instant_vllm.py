"""``python -m bench.instant_vllm --port P``: an OpenAI-compatible server that answers at once, with every prompt
"cached": the engine taken out, so that ``bench.throughput --vllm-url`` against it measures the app's own request
path alone (its answers/s ceiling and CPU per answer) on any machine, this one included. It is a benchmark's
instrument, never a test's: vLLM's real counters, scheduling and tokenizer are what the tests use.

It serves what the app reads of vLLM: ``/v1/models``, ``/metrics`` (the cache config and counters the app and
the benchmark read), ``/tokenize`` (four characters a token; with ``--tokenizer DIR`` that tokenizer's ids of the
rendered chat, and DIR as the served model's root, so the app's token-id prompts engage as against a real vLLM),
``/v1/chat/completions`` and ``/v1/completions``, streamed or not, ``--tokens`` answer tokens each, and
``/reset_prefix_cache`` (a no-op) for the benchmarks that reset between modes. Written on
aiohttp (vLLM's own dependency), one process, so that it costs far less per answer than the app it measures."""

from __future__ import annotations

import argparse
import json
import time

from aiohttp import web

MODEL = "instant"


class Counters:
    def __init__(self) -> None:
        self.requests = self.prompt_tokens = 0

    def text(self, kv_tokens: int) -> str:
        return "\n".join([
            f'vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",'
            f'kv_cache_size_tokens="{kv_tokens}"}} 1.0',
            "vllm:num_requests_waiting 0.0", "vllm:num_requests_running 0.0", "vllm:kv_cache_usage_perc 0.0",
            f"vllm:prefix_cache_queries_total {self.prompt_tokens}.0",
            f"vllm:prefix_cache_hits_total {self.prompt_tokens}.0",
            f"vllm:request_success_total {self.requests}.0", ""])


def prompt_tokens(body: dict) -> int:
    if "prompt" in body:
        prompt = body["prompt"]
        return len(prompt) if isinstance(prompt, list) else len(prompt) // 4 + 1
    return sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4 + 8


def build(tokens: int, max_model_len: int, kv_tokens: int, tokenizer_dir: str | None = None) -> web.Application:
    counters = Counters()
    root, tokenizer = MODEL, None
    if tokenizer_dir:
        from transformers import AutoTokenizer

        root, tokenizer = tokenizer_dir, AutoTokenizer.from_pretrained(tokenizer_dir)

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "root": root, "max_model_len": max_model_len}]})

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=counters.text(kv_tokens))

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        if tokenizer is not None and "messages" in body:  # as vLLM's /tokenize builds a chat's prompt
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:
            ids = list(range(prompt_tokens(body)))
        return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": max_model_len})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        completion = "prompt" in body
        n, out = prompt_tokens(body), min(tokens, int(body.get("max_tokens") or tokens))
        counters.requests, counters.prompt_tokens = counters.requests + 1, counters.prompt_tokens + n
        usage = {"prompt_tokens": n, "completion_tokens": out, "total_tokens": n + out,
                 "prompt_tokens_details": {"cached_tokens": n}}
        base = {"id": "instant", "created": int(time.time()), "model": MODEL,
                "object": "text_completion" if completion else "chat.completion"}
        if not body.get("stream"):
            text = " tok" * out
            choice = {"index": 0, "finish_reason": "length",
                      **({"text": text} if completion else {"message": {"role": "assistant", "content": text}})}
            return web.json_response(base | {"choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(out):
            piece = {"text": " tok"} if completion else {"delta": {"content": " tok"}}
            choice = {"index": 0, "finish_reason": "length" if i == out - 1 else None, **piece}
            await response.write(b"data: " + json.dumps(base | {"choices": [choice]}).encode() + b"\n\n")
        await response.write(b"data: " + json.dumps(base | {"choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def reset(_: web.Request) -> web.Response:  # nothing is cached: a reset has nothing to drop
        return web.Response(text="")

    async def missing(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "not served"}}, status=404)

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.get("/metrics", metrics), web.post("/tokenize", tokenize),
                    web.post("/v1/chat/completions", generate), web.post("/v1/completions", generate),
                    web.get("/health", health), web.post("/reset_prefix_cache", reset),
                    web.get("/tokenizer_info", missing)])
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instant_vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--tokens", type=int, default=16, help="answer tokens per request (at most max_tokens)")
    parser.add_argument("--max-model-len", type=int, default=32768, help="the window it reports (tokens)")
    parser.add_argument("--kv-tokens", type=int, default=900_000, help="the KV cache size it reports (tokens)")
    parser.add_argument("--tokenizer", metavar="DIR", help="a served model's folder (tokenizer and chat template): "
                        "reported as the model's root and used by /tokenize (default: none, four characters a token)")
    args = parser.parse_args(argv)
    web.run_app(build(args.tokens, args.max_model_len, args.kv_tokens, args.tokenizer), host="127.0.0.1",
                port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
