"""A fake vLLM for the fast test tier, put in at the one seam (``create_app(..., llm=)``/``build_services``).

It subclasses the real client, so every request is still built by ``LLMClient.chat_request``; only the network
calls are replaced. Its prefix cache works like vLLM's: a prompt is tokenized (4-character pieces, through the
test model's chat template), cut into blocks, each block keyed by everything before it; ``cached_tokens`` is
the leading blocks already seen. Over-long prompts get vLLM's 400. The answer text is fixed."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import threading
from types import SimpleNamespace

from app.core.errors import ContextTooLong
from app.core.settings import VLLMSettings
from app.vllm.client import LLMClient
from app.vllm.prompt_pieces import TokenPrompt
from app.vllm.testmodel import CHAT_TEMPLATE
from app.vllm.wire import Completion, Delta

BLOCK = 16


@functools.cache
def _chat_template():
    from jinja2 import Template

    return Template(CHAT_TEMPLATE)  # compiled once, not per request


class FakeVLLM(LLMClient):
    def __init__(self, max_model_len: int = 4096, answer: str = "The documents say so [a.md::0].") -> None:
        super().__init__(VLLMSettings(url="http://fake-vllm.invalid/v1"))
        self.max_model_len, self.answer = max_model_len, answer
        self.blocks: set[str] = set()
        self.queries = 0  # prompt tokens seen, as vllm:prefix_cache_queries_total
        self.prompts: list[list[dict]] = []  # every prompt sent, in order
        self.salts: list[str | None] = []  # each one's cache_salt
        self.offload_gib: float | None = None  # a KV tier in host memory, as vLLM's --kv-offloading-size reports it
        self.root = ""  # the model folder /v1/models names

    @staticmethod
    def render(messages: list[dict]) -> str:
        return _chat_template().render(messages=messages, add_generation_prompt=True)

    def tokens(self, messages: list[dict]) -> list[str]:
        text = self.render(messages)
        return [text[i:i + 4] for i in range(0, len(text), 4)]

    def _serve(self, request: dict) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of one request, caching its full blocks as vLLM does."""
        tokens = self.tokens(request["messages"])
        if len(tokens) + request["max_tokens"] > self.max_model_len:
            raise ContextTooLong(f"This model's maximum context length is {self.max_model_len} tokens",
                                 param="messages")
        self.prompts.append(request["messages"])
        self.queries += len(tokens)
        salt = request.get("extra_body", {}).get("cache_salt")  # as vLLM: blocks of another salt never match
        self.salts.append(salt)
        key, cached, hitting = hashlib.sha256((salt or "").encode()), 0, True
        for start in range(0, len(tokens) - len(tokens) % BLOCK, BLOCK):
            key.update("".join(tokens[start:start + BLOCK]).encode())
            block = key.hexdigest()
            hitting = hitting and block in self.blocks
            cached += BLOCK if hitting else 0
            self.blocks.add(block)
        return len(tokens), cached

    async def stream_chat(self, request: dict, result: Completion, prompt_ids: TokenPrompt | None = None):
        assert prompt_ids is None  # token-id prompts need the served tokenizer on this machine: never here
        result.prompt_tokens, result.cached_tokens = self._serve(request)
        for word in self.answer.split(" ")[:request["max_tokens"]]:
            result.text += word + " "
            result.completion_tokens += 1
            yield Delta(word + " ")
        result.finish_reason = "stop"

    async def complete(self, request: dict):
        prompt, cached = self._serve(request)
        return SimpleNamespace(usage=SimpleNamespace(prompt_tokens=prompt, completion_tokens=1,
                                                     prompt_tokens_details=SimpleNamespace(cached_tokens=cached)))

    async def tokenize(self, messages: list[dict]) -> list[int]:
        return [hash(token) for token in self.tokens(messages)]

    async def list_models(self) -> list[dict]:
        return [{"id": "fake-vllm", "max_model_len": self.max_model_len, "root": self.root}]

    async def special_tokens(self) -> list[str]:
        return []

    async def metrics_text(self, replica: str | None = None) -> str:
        return (f'vllm:cache_config_info{{block_size="{BLOCK}",enable_prefix_caching="True",'
                f'kv_cache_size_tokens="1000000",kv_offloading_size="{self.offload_gib}"}} 1.0\n'
                f'vllm:prefix_cache_queries_total {self.queries}.0\n')

    async def replicas(self):
        return None

    async def reset_prefix_cache(self) -> None:
        self.blocks.clear()


class GatedVLLM(FakeVLLM):
    """Answers only once ``gate`` is set: its requests hold their places of admission until then."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def stream_chat(self, request, result, prompt_ids=None):
        while not self.gate.is_set():
            await asyncio.sleep(0.01)
        async for delta in super().stream_chat(request, result, prompt_ids):
            yield delta
