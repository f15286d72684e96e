"""Token-id prompts: a cached prompt head is tokenized once, here, not by vLLM on every request.

A prefix-cache hit skips prefill, but vLLM's API server still renders the chat template and tokenizes the whole
prompt on every request, work that grows with the prompt (measured: docs/design.md, token-id prompts). So where
this machine has the served model's tokenizer, the app renders the chat template itself, keeps the token ids of
each prompt's head (the context's opening units, which every question about them shares whatever hits follow;
short of those, the first of them, or the system prompt, which every prompt shares), tokenizes only the rest (of
that, only the text between the context's pieces: ``app.vllm.prompt_pieces`` keeps each piece's ids) and sends the
ids to ``/v1/completions``. On unless ``PREFIXRAG_VLLM__TOKEN_ID_PROMPTS=false``.

Exact or unused: a head is used only after its ids, computed here, equalled vLLM's own ``/tokenize`` of a whole
prompt, in the background (a request none of whose heads is known goes as a chat, as before; pre-warm learns each
unit's head and the system prompt's as it sends them); one disagreement turns the feature off until vLLM
changes. Re-tokenizing from ``MARGIN_TOKENS`` before the head's end keeps merges across the cut exact (tokenizers
merge within words, never across this many tokens; each head's cut is checked once).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from app.core.errors import ServiceError
from app.core.settings import VLLMSettings
from app.vllm.model_files import local_folder
from app.vllm.prompt_pieces import Cut, Pieces, TokenPrompt, check, encode

log = logging.getLogger("prefixrag.prompt_ids")
MARGIN_TOKENS = 16
HEADS = 512  # heads kept (one per unit, page or conversation start; ~24 KB of JSON each at 4K tokens)
LEARNING = 2  # heads checked against vLLM at a time (background work; more wait for a later request)
LOOP_TAIL_CHARS = 2048  # a tail (its text outside known pieces) up to this long is tokenized on the event loop
# (~0.5 ms at most), a longer one on a thread, where the tokenizer releases the interpreter's lock
Leads = list[str] | tuple[str, ...]  # where a prompt's head may end, longest first (never a bare str)


class PromptIds:
    def __init__(self, settings: VLLMSettings, llm: Any, loaded: Callable[[], None] = lambda: None) -> None:
        self.settings, self.llm = settings, llm
        self._loaded = loaded  # called once the tokenizer is loaded (the composition root freezes what it left)
        self.tokenizer: Any = None  # the served model's (transformers), loaded once vLLM is known
        # head -> (its ids as a JSON array without the closing bracket, where tails start)
        self.heads: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        # A request's ids are made on the event loop: rendering, a lookup and a short tail's tokenization, a
        # fraction of a millisecond, where a hop to a thread waits for the interpreter's lock that a busy loop
        # holds, and the requests queued behind a long tail's. A long tail is tokenized on a thread; learning (a
        # whole prompt tokenized) on another, never ahead of a request. Each thread has a tokenizer of its own
        # (a fast tokenizer is not to be shared between threads).
        self._tails = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-ids")
        self._tails_tokenizer: Any = None
        self._learner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prompt-ids-learn")
        self._learner_tokenizer: Any = None
        self._learning: set[bytes] = set()
        self._declined: OrderedDict[bytes, None] = OrderedDict()  # heads whose cut would not re-tokenize alike
        self._tasks: set[asyncio.Task[None]] = set()
        self.pieces = Pieces()  # the ids of the context's pieces, for tails
        self._loading: asyncio.Task[None] | None = None  # the served tokenizer's load, after vLLM (re)appeared

    @property
    def active(self) -> bool:
        return self.tokenizer is not None

    def adopt(self, info: Any) -> None:
        """Upstream subscriber: vLLM (re)appeared, maybe with another model: drop what was learnt, reload."""
        self.tokenizer = self._learner_tokenizer = self._tails_tokenizer = None
        self.heads.clear()
        self._declined.clear()
        self.pieces.clear()
        if self.settings.token_id_prompts:
            self._loading = self._spawn(self._load(self.settings.tokenizer or info.root))

    async def ids(self, messages: list[dict[str, Any]], question: str,
                  leads: Leads = (), pieces: Sequence[str] = ()) -> TokenPrompt | None:
        """The prompt's token ids, exactly as vLLM would make them; None: send it as a chat (no tokenizer here,
        no head's end found in the rendering, or none of its heads learnt yet). The head ends after the first
        of ``leads`` (longest first: the context's opening units, shared by every question about them whatever
        follows; then shorter ones, e.g. the first of those units) that was learnt, or, where no lead is found,
        where ``question`` (the rendered last question) starts. The longest is learnt meanwhile if it was not.
        ``pieces``: the context's units and chunks as rendered, in prompt order (those the tail shows are not
        tokenized again once their ids are known)."""
        if self.tokenizer is None:
            return None
        try:
            known, longest = self._known_head(messages, question, leads)
            if longest is not None and self._unlearnt(key := longest[0]) and len(self._learning) < LEARNING:
                self._learning.add(key)
                self._spawn(self._learn(messages, *longest))
            return None if known is None else await self._with_tail(*known, pieces)
        except Exception as exc:  # an optimisation never fails a request (e.g. the tokenizer dropped meanwhile)
            log.warning("prompt sent as a chat: its token ids failed (%s)", exc)
            return None

    async def _with_tail(self, head_json: bytes, text: str, tail_start: int, pieces: Sequence[str]) -> TokenPrompt:
        cut = self.pieces.cut(text, tail_start, pieces) if self.pieces.on and pieces else Cut(text[tail_start:])
        texts = cut.texts()
        if sum(map(len, texts)) <= LOOP_TAIL_CHARS:
            text_ids = encode(self.tokenizer, texts)
        else:
            loop = asyncio.get_running_loop()
            text_ids = await loop.run_in_executor(self._tails, encode, self._tails_tokenizer, texts)
        if cut.spans and self.pieces.claim_check(cut):
            self._spawn(self._check_pieces(cut))
        reused = cut.reused
        return TokenPrompt(head_json, cut.fragments(text_ids), reused, len(cut.spans) - reused)

    async def _check_pieces(self, cut: Cut) -> None:
        """Learn the new pieces ``cut`` shows, or check its composition again (``prompt_pieces.check``)."""
        generation = self.pieces.generation
        try:
            loop = asyncio.get_running_loop()
            learnt = await loop.run_in_executor(self._learner, check, self._learner_tokenizer, cut)
            if learnt is None:
                log.warning("a tail composed from its pieces' ids differs from the tail tokenized whole: pieces off, "
                            "tails tokenized whole")
                self.pieces.turn_off()
            else:
                self.pieces.keep(learnt, generation)
        except Exception as exc:  # the tokenizer dropped meanwhile (vLLM changed), or failed on this text
            log.info("a prompt's pieces were not learnt: %s", exc)
        finally:
            self.pieces.checking = False

    async def learn(self, messages: list[dict[str, Any]], lead: str) -> None:
        """Learn the head of a prompt sent ahead of the questions that will open with ``lead`` (pre-warm's units),
        so that the first of them already goes as token ids; checked against vLLM as any head is. ``lead``'s ids
        as a piece too, for the questions that show it after other units."""
        if self._loading is not None and not self._loading.done():  # pre-warm starts as vLLM appears
            await asyncio.shield(self._loading)
        if self.tokenizer is None or not lead:
            return
        try:
            _, head = self._known_head(messages, "", (lead,))
        except Exception as exc:  # the tokenizer dropped meanwhile, or failed on this text: users learn it
            log.info("a pre-warmed prompt head was not learnt: %s", exc)
            return
        if head is None:
            return
        if self._unlearnt(key := head[0]):
            self._learning.add(key)
            await self._learn(messages, *head)
        if (cut := self.pieces.cut(head[1], 0, (lead,))).learns and self.pieces.claim_check(cut):
            await self._check_pieces(cut)

    def _unlearnt(self, key: bytes) -> bool:
        """Neither known, nor being learnt, nor declined (its cut would not re-tokenize alike)."""
        return key not in self.heads and key not in self._learning and key not in self._declined

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tails.shutdown(wait=False, cancel_futures=True)
        self._learner.shutdown(wait=False, cancel_futures=True)

    def _spawn(self, coroutine: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _known_head(self, messages: list[dict[str, Any]], question: str, leads: Leads
                    ) -> tuple[tuple[bytes, str, int] | None, tuple[bytes, str, int] | None]:
        """((the longest head learnt's ids as JSON, the rendered prompt, where its tail starts) or None, (the
        longest head's key, the rendered prompt, where that head ends) or None if no head's end was found)."""
        text = self._render(messages)
        longest = None
        for cut in _cuts(text, question, leads):
            key = hashlib.blake2b(text[:cut].encode(), digest_size=16).digest()
            longest = longest or (key, text, cut)
            if (head := self.heads.get(key)) is not None:
                self.heads.move_to_end(key)
                head_json, tail_start = head
                return (head_json, text, tail_start), longest
        return None, longest

    async def _learn(self, messages: list[dict[str, Any]], key: bytes, text: str, cut: int) -> None:
        try:
            loop = asyncio.get_running_loop()
            if self._learner_tokenizer is None:  # vLLM changed meanwhile
                return
            head = await loop.run_in_executor(self._learner, self._split, text, cut)
            if head is None:  # not learnt again: it would cost a whole tokenization per request for nothing
                _remember(self._declined, key, None)
                return
            if self.tokenizer is None:
                return
            ids, first_tail_token, tail_start = head
            if await self.llm.tokenize(messages) != ids:
                log.warning("the local tokenizer disagrees with vLLM's on a prompt: token-id prompts off")
                self.tokenizer = None
                return
            _remember(self.heads, key, (TokenPrompt.open_array(ids[:first_tail_token]), tail_start))
        except ServiceError as exc:  # vLLM busy or gone: the next request tries again
            log.info("a prompt head was not learnt: %s", exc.message)
        except Exception as exc:  # the tokenizer failed on it: chats, as before
            log.warning("a prompt head was not learnt: %s", exc)
        finally:
            self._learning.discard(key)

    def _split(self, text: str, cut: int) -> tuple[list[int], int, int] | None:
        """The whole prompt's ids, its tail's first token and that token's first character (``MARGIN_TOKENS``
        before ``cut``), if re-tokenizing the tail alone gives the same ids (else this head is not cached)."""
        tokenizer = self._learner_tokenizer
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        before_cut = sum(1 for _, end in offsets if end <= cut)
        first_tail_token = before_cut - MARGIN_TOKENS
        if first_tail_token <= 0:
            return None
        tail_start = offsets[first_tail_token][0]
        if ids[first_tail_token:] != encode(tokenizer, [text[tail_start:]])[0]:
            return None
        return ids, first_tail_token, tail_start

    def _render(self, messages: list[dict[str, Any]]) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    async def _load(self, root: str | None) -> None:
        """The tokenizer of the folder or hub id ``root`` (a hub id from the local Hugging Face cache)."""
        folder = Path(root) if root and Path(root).is_dir() else local_folder(root or "")
        if folder is None:
            log.warning("token-id prompts off: the served model's tokenizer is not on this machine (%s), so vLLM "
                        "renders and tokenizes every prompt again; PREFIXRAG_VLLM__TOKENIZER names a local copy", root)
            return
        path = str(folder)
        loop = asyncio.get_running_loop()
        try:
            self._learner_tokenizer = await loop.run_in_executor(self._learner, _load_tokenizer, path)
            self._tails_tokenizer = await loop.run_in_executor(self._learner, _load_tokenizer, path)
            self.tokenizer = await loop.run_in_executor(self._learner, _load_tokenizer, path)
        except Exception as exc:  # not a tokenizer folder, no chat template: chats as before
            log.warning("token-id prompts off: %s could not be loaded (%s)", path, exc)
            return
        log.info("token-id prompts on: tokenizer from %s", path)
        self._loaded()


def _cuts(text: str, question: str, leads: Leads) -> Iterator[int]:
    """Where each lead found in ``text`` ends (in the order given), or, where none is, where ``question``
    starts (its last occurrence)."""
    found = False
    for lead in leads:
        if lead and (at := text.find(lead)) >= 0:  # one scan each, not a membership test and then a find
            found = True
            yield at + len(lead)
    if not found and (at := text.rfind(question)) > 0:
        yield at


def _remember(table: OrderedDict[bytes, Any], key: bytes, value: Any) -> None:
    """Keep ``value`` under ``key``, dropping the oldest entries beyond ``HEADS``."""
    table[key] = value
    while len(table) > HEADS:
        table.popitem(last=False)


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.is_fast or not tokenizer.chat_template:
        raise ValueError("a fast tokenizer with a chat template is needed")
    return tokenizer
