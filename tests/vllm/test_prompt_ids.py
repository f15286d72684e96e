"""Token-id prompts (``app.vllm.prompt_ids``) against the real vLLM test server: exactly vLLM's ids or not used."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import httpx
import pytest

from app.core.settings import Settings, VLLMSettings
from app.rag.context import PromptBuilder
from app.runtime.services import build_services
from app.serve.app import create_app
from app.vllm import prompt_ids
from app.vllm.prompt_ids import LOOP_TAIL_CHARS
from app.vllm.prompt_pieces import encode
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

    @classmethod
    async def with_system_head(cls, vllm_url: str, embedder) -> Client:
        """A client whose served tokenizer is loaded and whose system prompt's head is learnt (as pre-warm does)."""
        client = await cls.open(vllm_url, embedder)
        await client.upstream.refresh()
        await until(lambda: client.prompt_ids.active)
        await client.prompt_ids.learn(client.builder.warmup_messages(), client.builder.system_prompt)
        return client

    def scattered(self, documents: str, question: str) -> list[dict]:
        """A prompt whose context opens with hits of its own: its only head is the system prompt."""
        context = f"<documents>\n{documents}</documents>\n"
        return [{"role": "system", "content": self.builder.system_prompt},
                {"role": "user", "content": context + self.builder.question(question)}]

    def messages(self, question: str, extra: str = "") -> list[dict]:
        context = f"<documents>\n{LEAD}{extra}</documents>\n"
        return [{"role": "system", "content": self.builder.system_prompt},
                {"role": "user", "content": context + self.builder.question(question)}]

    async def ids(self, question: str, extra: str = "") -> list[int] | None:
        return await self.prompt_ids.ids(self.messages(question, extra), self.builder.question(question), (LEAD,))

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
            assert ids is not None and ids.ids() == await client.llm.tokenize(client.messages(question, extra))
        assert len(client.prompt_ids.heads) == 1
        await client.close()

    asyncio.run(run())


def test_a_context_opening_with_a_hit_of_its_own_goes_as_ids_after_the_system_prompt(vllm_url, embedder):
    """Scattered hits, a conversation's later turns: no unit opens the context, so the head is the system prompt,
    learnt once (pre-warm sends it first), and every such prompt goes as exactly vLLM's ids."""
    async def run():
        client = await Client.with_system_head(vllm_url, embedder)  # as pre-warm does with its prefix
        builder, system = client.builder, client.builder.system_prompt
        assert len(client.prompt_ids.heads) == 1
        long_tail = ("Which quay is longest?", LEAD.replace("Harbour", "Quay"))  # tokenized off the event loop
        assert len(long_tail[1]) > LOOP_TAIL_CHARS
        for question, extra in (*QUESTIONS, long_tail):  # other hits, other questions: nothing shared after the
            # system prompt
            messages = client.scattered(extra, question)
            ids = await client.prompt_ids.ids(messages, builder.question(question), (system,))
            assert ids is not None and ids.ids() == await client.llm.tokenize(messages)
        assert len(client.prompt_ids.heads) == 1
        await client.close()

    asyncio.run(run())


def test_a_tails_pieces_are_tokenized_once_and_their_ids_compose_exactly_what_vllm_makes(vllm_url, embedder,
                                                                                          monkeypatch):
    """Contexts opening with hits of their own (the head is the system prompt): the first prompt showing a piece
    tokenizes its tail whole and learns the piece meanwhile (pre-warm learns the pieces it sends); later prompts
    showing it in other orders and beside other hits tokenize only the text around it, and still go as exactly
    vLLM's ids."""
    tokenized: list[int] = []  # characters each request tokenized on its path (the learner's calls are not)

    def spied(tokenizer, texts):
        if threading.current_thread().name.startswith("prompt-ids-learn"):
            return encode(tokenizer, texts)
        tokenized.append(sum(map(len, texts)))
        return encode(tokenizer, texts)

    async def run():
        client = await Client.with_system_head(vllm_url, embedder)
        builder, system = client.builder, client.builder.system_prompt
        units = [f'<document id="fact-{i}">\n' + f"Fact {i} about the harbour: the quay held {i} boats. " * 8
                 + "\n</document>\n" for i in range(4)]
        warm = [{"role": "system", "content": system},
                {"role": "user", "content": f"<documents>\n{units[3]}</documents>\n"}]
        known = client.prompt_ids.pieces.known
        before = len(known)  # pre-warm's stable prefix may be one
        await client.prompt_ids.learn(warm, units[3])  # as pre-warm sends a unit: its piece is learnt too
        assert len(known) == before + 1
        orders = ([0, 1], [1, 2, 0], [3, 0], [2, 1, 3], [0, 1])
        for number, order in enumerate(orders):
            shown, question = [units[i] for i in order], f"Question {number}?"
            messages = client.scattered("".join(shown), question)
            ids = await client.prompt_ids.ids(messages, builder.question(question), (system,), shown)
            assert ids is not None and ids.ids() == await client.llm.tokenize(messages), number
            await until(lambda: not client.prompt_ids.pieces.checking)
        assert len(known) == before + 4 and client.prompt_ids.pieces.on
        assert tokenized[0] > sum(map(len, units[:2])) and max(tokenized[2:]) < 400  # from the third on, no
        # piece is tokenized again (the third's first unit was pre-warmed)
        await client.close()

    monkeypatch.setattr(prompt_ids, "encode", spied)
    asyncio.run(run())


def test_pieces_whose_ids_would_not_compose_exactly_are_never_used(vllm_url, embedder):
    """A piece cut inside a word (the template never does that; a tokenizer that merged across a piece's edge
    would): its composition differs from the tail tokenized whole, so pieces go off and tails are tokenized
    whole, exactly as vLLM does."""
    async def run():
        client = await Client.with_system_head(vllm_url, embedder)
        word = "harbourquay" * 40
        for number in range(3):
            question = f"Question {number}?"
            messages = client.scattered(f"Intro {word}side.\n", question)
            ids = await client.prompt_ids.ids(messages, client.builder.question(question),
                                              (client.builder.system_prompt,), [word])
            assert ids is not None and ids.ids() == await client.llm.tokenize(messages), number
            await until(lambda: not client.prompt_ids.pieces.checking)
            assert not client.prompt_ids.pieces.on and not client.prompt_ids.pieces.known
        await client.close()

    asyncio.run(run())


def test_where_several_units_open_a_context_the_first_ones_head_serves_and_the_whole_lead_is_learnt(vllm_url,
                                                                                                     embedder):
    """Small documents come several to a prompt: the head of the first unit (pre-warm sent it alone) serves that
    prompt at once, and the whole lead is learnt meanwhile, for the next question on the same units."""
    async def run():
        client = await Client.open(vllm_url, embedder)
        await client.upstream.refresh()
        await until(lambda: client.prompt_ids.active)
        await client.prompt_ids.learn(client.messages("warm?"), LEAD)  # as pre-warm does with a unit
        assert len(client.prompt_ids.heads) == 1
        second = '<document id="second">\nThe second unit of this context.\n</document>\n'
        leads = (LEAD + second, LEAD, client.builder.system_prompt)
        for number, question in enumerate(("Which unit?", "And now?", "Once more?")):
            messages = client.messages(question, second)
            ids = await client.prompt_ids.ids(messages, client.builder.question(question), leads)
            assert ids is not None and ids.ids() == await client.llm.tokenize(messages)
            if number == 0:
                await until(lambda: len(client.prompt_ids.heads) == 2)  # the whole lead, learnt meanwhile
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
    """The same question through a service sending chats, then through one sending token ids: the same prompt,
    and the second hits what the first left in vLLM's cache."""
    question = "What colour is the sky on Mars?"

    def answer(token_ids: bool) -> tuple[dict, dict[str, float]]:
        settings = app_settings(collections, vllm_url, top_k=4)  # all four facts, every time
        settings.vllm.token_id_prompts = token_ids
        with AppServer(create_app(settings, embedder=embedder)) as server:
            server.wait_ready()
            warmed(server.url)  # pre-warm learns the head as it sends the stable prefix
            response = httpx.post(server.url + "/ask", json={"question": question, "max_tokens": 4}, timeout=60)
            assert response.status_code == 200, response.text
            metrics = httpx.get(server.url + "/metrics").text
        return response.json(), sent_forms(metrics)

    chat, chat_forms = answer(token_ids=False)
    by_ids = answer(token_ids=True)
    assert chat_forms == {"chat": 1.0} and by_ids[1] == {"token_ids": 1.0}
    assert by_ids[0]["usage"]["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert by_ids[0]["usage"]["cached_tokens"] >= chat["usage"]["prompt_tokens"] // 128 * 128 - 128 > 0
    assert by_ids[0]["answer"]


def warmed(url: str) -> dict:
    """``/readyz`` once pre-warm is done (it fails if pre-warm stops or fails, or takes over two minutes)."""
    deadline = time.monotonic() + 120
    while (ready := httpx.get(url + "/readyz").json())["warmup"]["state"] != "done":
        assert time.monotonic() < deadline and not ready["warmup"]["state"].startswith(("stopped", "failed"))
        time.sleep(0.2)
    return ready


def sent_forms(metrics: str) -> dict[str, float]:
    """``prefixrag_prompts_total`` by form, as ``/metrics`` shows it (forms never sent are absent)."""
    return {form: float(line.split()[-1]) for form in ("token_ids", "chat") for line in metrics.splitlines()
            if line.startswith(f'prefixrag_prompts_total{{form="{form}"}}') and float(line.split()[-1])}


def test_a_pre_warmed_units_first_question_already_goes_as_token_ids(collections, vllm_url, embedder):
    """Pre-warm learns each unit's prompt head as it sends it: no question pays the chat path to teach it."""
    settings = app_settings(collections, vllm_url, top_k=4, strategy="document")
    settings.vllm.token_id_prompts = True
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        ready = warmed(server.url)
        assert ready["warmup"]["units_warmed"] >= 1, json.dumps(ready)
        response = httpx.post(server.url + "/ask", json={"question": "What colour is the sky on Mars?",
                                                         "max_tokens": 4}, timeout=60)
        assert response.status_code == 200, response.text
        metrics = httpx.get(server.url + "/metrics").text
    assert sent_forms(metrics) == {"token_ids": 1.0}


def test_after_pre_warm_questions_whose_contexts_open_with_their_own_hits_go_as_token_ids(collections, vllm_url,
                                                                                          embedder):
    """The canonical strategy: every context opens with a hit, and each question here has its own set of hits."""
    settings = app_settings(collections, vllm_url, top_k=2)
    settings.vllm.token_id_prompts = True
    questions = ("What colour is the sky on Mars?", "Why do tides rise twice a day?", "Where does a compass point?")
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        warmed(server.url)
        cited = set()
        for question in questions:
            response = httpx.post(server.url + "/ask", json={"question": question, "max_tokens": 4}, timeout=60)
            assert response.status_code == 200, response.text
            cited.add(tuple(sorted(source["id"] for source in response.json()["sources"])))
        metrics = httpx.get(server.url + "/metrics").text
    assert len(cited) > 1  # the contexts differ: no head up to the question could have been shared
    assert sent_forms(metrics) == {"token_ids": float(len(questions))}


def test_pre_warmed_units_after_other_units_go_as_their_kept_ids(vllm_url, embedder, tmp_path):
    """Each note its own unit, pre-warmed (their pieces learnt as they are sent); questions whose contexts show
    several of them reuse the units' ids after the first, and ``/metrics`` counts the pieces reused."""
    from ingest.pipeline import run_ingest
    from tests.support.corpora import write_notes

    docs, chroma = tmp_path / "docs", tmp_path / "chroma"
    notes = write_notes(docs)
    settings = app_settings(chroma, vllm_url, collection="pieces", strategy="document", top_k=4, hotness_dir=None)
    settings.pages.tokens = 0
    settings.vllm.token_id_prompts = True
    run_ingest([docs], settings, embedder)
    questions = [" ".join(text.split()[:12]) + "?" for text in list(notes.values())[:6]]
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        warmed(server.url)
        for question in questions:
            response = httpx.post(server.url + "/ask", json={"question": question, "max_tokens": 4}, timeout=60)
            assert response.status_code == 200, response.text
        metrics = httpx.get(server.url + "/metrics").text
    pieces = {state: float(line.split()[-1]) for state in ("reused", "tokenized") for line in metrics.splitlines()
              if line.startswith(f'prefixrag_prompt_pieces_total{{state="{state}"}}')}
    assert sent_forms(metrics) == {"token_ids": float(len(questions))}
    assert pieces.get("reused", 0) >= len(questions), pieces  # every question shows units after its first
