"""Token-id prompts (``app.vllm.prompt_ids``) against the real vLLM test server: exactly vLLM's ids or not used."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest

from app.core.settings import Settings, VLLMSettings
from app.rag.context import PromptBuilder
from app.runtime.services import build_services
from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.servers import AppServer

pytestmark = pytest.mark.vllm
LEAD = "".join(f'<document id="harbour-{i}">\nHarbour fact {i}: the quay held {10 + i} boats.\n</document>\n'
               for i in range(30))  # the opening unit(s) every question about them shares
QUESTIONS = (("When was the quay extended?", ""),
             ("ünïcode — [SEP] <s> 1,234.5 %\n\nand a second line?", '<document id="ice">\nIce: 20 m.\n</document>\n'),
             ("x", '<document id="other">\nAnother hit after the unit.\n</document>\n'))


async def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


class Client:
    """The app's own service graph (``build_services``) over the real vLLM; ``tokenizer``: PREFIXRAG_VLLM__TOKENIZER."""

    @classmethod
    async def open(cls, vllm_url: str, embedder, tokenizer: str | None = None, enabled: bool = True) -> Client:
        settings = Settings(_env_file=None)
        settings.vllm.url, settings.vllm.tokenizer = vllm_url, tokenizer
        settings.vllm.token_id_prompts = enabled
        self = cls()
        self.services = await build_services(settings, embedder=embedder)
        self.builder = PromptBuilder(self.services.clients.templates)
        self.llm, self.upstream = self.services.llm, self.services.upstream
        self.prompt_ids = self.services.clients.prompt_ids
        return self

    def messages(self, question: str, extra: str = "") -> list[dict]:
        context = f"<documents>\n{LEAD}{extra}</documents>\n"
        return [{"role": "system", "content": self.builder.system_prompt},
                {"role": "user", "content": context + self.builder.question(question)}]

    async def ids(self, question: str, extra: str = "") -> list[int] | None:
        return await self.prompt_ids.ids(self.messages(question, extra), self.builder.question(question), LEAD)

    async def close(self) -> None:
        await self.services.aclose()


def test_a_head_seen_before_goes_as_exactly_the_ids_vllm_makes(vllm_url, embedder):
    async def run():
        client = await Client.open(vllm_url, embedder)
        await client.upstream.refresh()  # the served model's folder is on this machine: its tokenizer loads
        await until(lambda: client.prompt_ids.active)
        assert await client.ids("first?") is None  # an unseen head goes as a chat, and is learnt meanwhile
        await until(lambda: len(client.prompt_ids.heads) == 1)
        for question, extra in QUESTIONS:  # the same opening unit, other hits after it, other questions
            ids = await client.ids(question, extra)
            assert ids is not None and ids == await client.llm.tokenize(client.messages(question, extra))
        assert len(client.prompt_ids.heads) == 1
        await client.close()

    asyncio.run(run())


def test_a_tokenizer_that_disagrees_with_vllm_is_never_used(vllm_url, embedder, tmp_path):
    async def run():
        served = await Client.open(vllm_url, embedder)
        await served.upstream.refresh()
        other = tmp_path / "tokenizer"  # the served tokenizer with a chat template vLLM does not use
        shutil.copytree(served.upstream.info.root, other)
        config = json.loads((other / "tokenizer_config.json").read_text())
        template = config["chat_template"]
        config["chat_template"] = template.replace("<|{{ message['role'] }}|>", "<{{ message['role'] }}>")
        (other / "tokenizer_config.json").write_text(json.dumps(config))
        await served.close()
        client = await Client.open(vllm_url, embedder, tokenizer=str(other))
        await client.upstream.refresh()
        await until(lambda: client.prompt_ids.active)
        assert await client.ids("first?") is None
        await until(lambda: not client.prompt_ids.active)  # vLLM's /tokenize said otherwise: off
        assert not client.prompt_ids.heads and await client.ids("first?") is None
        await client.close()

    asyncio.run(run())


def test_switched_off_or_without_the_served_tokenizer_here_prompts_go_as_chats(vllm_url, embedder, tmp_path):
    async def run():
        for options in ({"tokenizer": str(tmp_path / "absent")}, {"enabled": False}):
            client = await Client.open(vllm_url, embedder, **options)
            await client.upstream.refresh()
            await asyncio.sleep(0.5)
            assert not client.prompt_ids.active and await client.ids("first?") is None
            await client.close()
        assert VLLMSettings.model_fields["token_id_prompts"].default is True  # on where it is exact (long prompts)

    asyncio.run(run())


def test_answers_over_token_ids_are_cached_like_chats(collections, vllm_url, embedder):
    settings = app_settings(collections, vllm_url, top_k=4)  # all four facts, every time: one head
    settings.vllm.token_id_prompts = True

    def ask(question: str) -> dict:
        response = httpx.post(server.url + "/ask", json={"question": question, "max_tokens": 4}, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()

    def sent(form: str) -> float:
        text = httpx.get(server.url + "/metrics").text
        line = next((x for x in text.splitlines() if x.startswith(f'prefixrag_prompts_total{{form="{form}"}}')), "")
        return float(line.split()[-1]) if line else 0.0

    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        chat = ask("What colour is the sky on Mars?")
        deadline = time.monotonic() + 30
        while sent("token_ids") == 0:  # the head is learnt in the background after the first answer
            assert time.monotonic() < deadline, "no prompt went as token ids"
            by_ids = ask("What colour is the sky on Mars?")
        assert sent("chat") >= 1
    assert by_ids["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert by_ids["usage"]["cached_tokens"] >= chat["usage"]["prompt_tokens"] // 128 * 128 - 128 > 0
    assert by_ids["answer"]


def test_a_pre_warmed_units_first_question_already_goes_as_token_ids(collections, vllm_url, embedder):
    """Pre-warm learns each unit's prompt head as it sends it: no question pays the chat path to teach it."""
    settings = app_settings(collections, vllm_url, top_k=4, strategy="document")
    settings.vllm.token_id_prompts = True
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        deadline = time.monotonic() + 120
        while (ready := httpx.get(server.url + "/readyz").json())["warmup"]["state"] != "done":
            assert time.monotonic() < deadline and not ready["warmup"]["state"].startswith(("stopped", "failed"))
            time.sleep(0.2)
        assert ready["warmup"]["units_warmed"] >= 1, json.dumps(ready)
        response = httpx.post(server.url + "/ask", json={"question": "What colour is the sky on Mars?",
                                                         "max_tokens": 4}, timeout=60)
        assert response.status_code == 200, response.text
        metrics = httpx.get(server.url + "/metrics").text
    forms = {form: float(line.split()[-1]) for form in ("token_ids", "chat") for line in metrics.splitlines()
             if line.startswith(f'prefixrag_prompts_total{{form="{form}"}}')}
    assert forms.get("token_ids") == 1 and not forms.get("chat"), forms
