"""Pre-warm: put what requests will ask for into vLLM's prefix cache before they ask, without ever delaying
one. The lifespan owns one ``Warmer``; it starts when vLLM (re)appears or the collection changes, and runs in
the background: every warm-up request gives way to user traffic (``LiveTraffic.yielding``) and is sent at a
lower vLLM priority; the whole run is bounded by time and by an absolute token budget besides a KV share.
Readiness never waits for it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from app.core.pages import CHARS_PER_TOKEN
from app.errors import BadRequest, ServiceError, StoreUnavailable
from app.rag.affinity import affinity_key
from app.rag.context import ContextChunk
from app.rag.planner import ContextPlanner
from app.rag.traffic import LiveTraffic
from app.rag.units import Window, window_of
from app.rag.upstream import Upstream, UpstreamInfo

log = logging.getLogger("prefixrag.warmup")


@dataclass
class WarmupProgress:
    state: str = "waiting for vLLM"  # waiting for vLLM | warming | done | stopped: <why> | interrupted: <why>
    prefix_tokens: int = 0  # the stable prefix (system prompt): warmed first
    units_planned: int = 0
    units_warmed: int = 0
    tokens: int = 0  # prompt tokens sent by this warm-up, all of it
    token_budget: int = 0
    seconds: float = 0.0
    corpus_chunks: int | None = None
    corpus_tokens: int | None = None  # counted only when the estimate came near the window
    corpus_fits: bool | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"


class Warmer:
    def __init__(self, planner: ContextPlanner, upstream: Upstream, traffic: LiveTraffic) -> None:
        self.planner, self.upstream, self.traffic = planner, upstream, traffic
        self.settings, self.llm, self.builder = planner.settings, planner.llm, planner.builder
        self.progress = WarmupProgress()
        self.priority = self.settings.warm_priority  # dropped (0) if vLLM does not schedule by priority
        # What is cached now, with each prompt's routing key (benchmarks prime their ceiling with it and replay it).
        self.warmed_prompts: list[tuple[list[dict], str]] = []
        self._kick = asyncio.Event()
        self._run: asyncio.Task | None = None
        self._started = 0.0
        self._warmed_units: set[str] = set()  # unit keys this warm-up sent (a used window may be a first one)

    def restart(self) -> None:
        """Warm again from the start (the collection changed); the run in progress, if any, is dropped."""
        self._kick.set()

    async def run_forever(self) -> None:
        """Start a warm-up each time vLLM appears (or restarts) or ``restart`` is called."""
        appeared, kicked = self.upstream.appeared, self._kick
        try:
            while True:
                waits = [asyncio.ensure_future(appeared.wait()), asyncio.ensure_future(kicked.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for wait in waits:
                        wait.cancel()
                appeared.clear()
                kicked.clear()
                if self.upstream.info is not None:
                    await self.stop()
                    self._run = asyncio.create_task(self.warm(self.upstream.info), name="pre-warm")
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self._run and not self._run.done():
            self._run.cancel()
            await asyncio.gather(self._run, return_exceptions=True)

    async def warm(self, info: UpstreamInfo) -> WarmupProgress:
        """One whole warm-up: the stable prefix, the corpus decision, then the corpus or the hottest units."""
        self.progress, self.warmed_prompts, self._started = WarmupProgress(state="warming"), [], time.monotonic()
        self._warmed_units = set()
        with self.traffic.background():
            await self._warm_all(info)
        self.progress.seconds = round(time.monotonic() - self._started, 3)
        log.info("pre-warm %s: %d/%d units, %d tokens in %.1fs", self.progress.state, self.progress.units_warmed,
                 self.progress.units_planned, self.progress.tokens, self.progress.seconds)
        return self.progress

    async def _warm_all(self, info: UpstreamInfo) -> None:
        try:
            self.progress.prefix_tokens = await self._send(self.builder.warmup_messages(), [])
            await self._warm_context(info)
            if self.progress.state == "warming":
                self.progress.state = "done"
        except StoreUnavailable as exc:  # the collection watcher restarts us when it is back
            self.progress.state = f"interrupted: the collection is unavailable ({exc.message})"
        except ServiceError as exc:  # vLLM went away: it is re-warmed when the monitor sees it back
            self.progress.state = f"interrupted: {exc.message}"
        except Exception as exc:  # a bug must not leave "warming" on /readyz forever, nor pass unseen
            log.exception("pre-warm failed")
            self.progress.state = f"failed: {type(exc).__name__}: {exc}"

    async def _warm_context(self, info: UpstreamInfo) -> None:
        planner = self.planner
        # A unit must leave room for the question, the answer and the rest of the prompt.
        planner.units.max_unit_tokens = min(self.settings.max_unit_tokens,
                                            (info.max_model_len - self.settings.max_tokens) // 2)
        self.progress.token_budget = min(int(info.kv_cache_tokens * self.settings.warm_kv_share),
                                         self.settings.warm_max_tokens)
        if self.settings.strategy in ("corpus", "auto"):
            verdict = await planner.decide_corpus(info)
            self.progress.corpus_chunks, self.progress.corpus_tokens = verdict.chunks, verdict.tokens
            self.progress.corpus_fits = verdict.fits
        if planner.active is planner.corpus and planner.corpus.fits:
            self.progress.units_planned = 1
            await self._warm_unit(self._corpus_chunks)
        elif planner.active.name == "document":
            await self._warm_units()

    async def _warm_units(self) -> None:
        """Hottest units first (persisted use; before any traffic: biggest first). A page is one unit; a parent
        cut into windows is planned as its first window and as each of its windows that was used (hotness
        counts windows, never their parent). Then, while the bounds allow, every other window of those parents
        in the same order, so a question about any part of a big document finds it cached."""
        await self.planner.retriever.indexes_ready(("pages",))  # which parents are paged (BM25 is not needed)
        metas = await self.planner.retriever.chunks_where(None, texts=False)  # which parents, how big
        units = self.planner.units
        sizes: Counter[str] = Counter()
        first: dict[str, ContextChunk] = {}
        for chunk in metas:
            key = units.page_of(chunk) or chunk.parent
            sizes[key] += 1
            first.setdefault(key, chunk)
        hotness = self.planner.hotness
        parents = {chunk.parent for chunk in first.values()}
        used = {key for key in hotness.keys() if (window := window_of(key)) and window.parent_id in parents}
        order = sorted([*sizes, *used], key=lambda key: (-hotness.score(key), -sizes[key], key))
        self.progress.units_planned = len(order)
        window_size: dict[str, int] = {}  # parent id -> its windows' size, for each parent found cut into windows

        async def unit(key: str) -> tuple[str, list[ContextChunk]]:
            hit = first[key] if key in first else await units.window_start(key)  # else a window
            if hit is None:
                return key, []
            unit_key, chunks = await units.unit_for(hit)
            if window := window_of(unit_key):
                window_size[window.parent_id] = window.size
            return unit_key, chunks

        if not await self._warm_each(order, unit):
            return
        rest = [key for parent in order if parent in window_size  # from the scan's counts: nothing read again
                for start in range(0, sizes[parent], window_size[parent])
                if (key := Window(parent, start, window_size[parent]).key) not in self._warmed_units]
        self.progress.units_planned += len(rest)
        await self._warm_each(rest, unit)

    async def _warm_each(self, keys: list[str],
                         unit: Callable[[str], Awaitable[tuple[str, list[ContextChunk]]]]) -> bool:
        """Warm the units ``keys`` name, in order, ``warm_concurrency`` at a time; False once a bound stopped it."""
        queue = iter(keys)

        async def worker() -> bool:
            for key in queue:  # shared iterator: each unit is taken by one worker
                if not await self._warm_unit(lambda: unit(key)):  # noqa: B023  (awaited now)
                    return False
            return True

        return all(await asyncio.gather(*(worker() for _ in range(self.settings.warm_concurrency))))

    async def _corpus_chunks(self) -> tuple[str, list[ContextChunk]]:
        return "corpus", self.planner.corpus.chunks or []

    async def _warm_unit(self, unit_of: Callable[[], Awaitable[tuple[str, list[ContextChunk]]]]) -> bool:
        """Warm one unit unless a bound is reached (then record why and return False)."""
        if self.progress.tokens >= self.progress.token_budget:
            return self._stopped(f"token budget ({self.progress.token_budget})")
        if time.monotonic() - self._started >= self.settings.warm_max_s:
            return self._stopped(f"time budget ({self.settings.warm_max_s:g} s)")
        key, chunks = await unit_of()
        if not chunks or key in self._warmed_units:  # a used window that is its parent's first, or gone since
            self.progress.units_planned -= 1
            return True
        self._warmed_units.add(key)
        for end in self._piece_ends(chunks):
            await self._send(self.builder.messages(chunks[:end], ""), chunks[:end], whole=end == len(chunks))
        self.progress.units_warmed += 1
        return True

    def _piece_ends(self, chunks: list[ContextChunk]) -> list[int]:
        """Where to cut ``chunks``: each piece adds to the one before the chunks up to the first boundary past
        ``warm_piece_tokens`` (estimated from characters); the last end is the whole unit."""
        chars_per_token = self.planner.estimator.chars_per_token or CHARS_PER_TOKEN
        per_piece = self.settings.warm_piece_tokens * chars_per_token
        ends, grown = [], 0.0
        for end, chunk in enumerate(chunks, 1):
            grown += len(chunk.text)
            if per_piece and grown >= per_piece and end < len(chunks):
                ends.append(end)
                grown = 0.0
        return ends + [len(chunks)]

    def _stopped(self, why: str) -> bool:
        if self.progress.state == "warming":
            self.progress.state = f"stopped: {why}"
        return False

    async def _send(self, messages: list[dict], context: list[ContextChunk], whole: bool = True) -> int:
        """One warm-up request (1 output token), yielding to users, routed like the requests that will use its
        prefix (``affinity_key``); returns the prompt tokens vLLM counted. A piece (not ``whole``) only prepares
        the cache for the next one and is not counted."""
        key = affinity_key(context)
        response = await self.traffic.yielding(lambda: self._complete(messages, key))
        tokens = response.usage.prompt_tokens  # vLLM counted the prompt it just cached: no /tokenize
        self.planner.estimator.observe(messages, tokens)
        if not whole:
            return tokens
        self.warmed_prompts.append((messages, key))
        self.progress.tokens += tokens
        return tokens

    async def _complete(self, messages: list[dict], key: str):
        request = self.llm.chat_request(messages, max_tokens=1, temperature=0.0, prefix_key=key,
                                        stream=False, priority=self.priority or None)
        try:
            return await self.llm.complete(request)
        except BadRequest as exc:
            if not self.priority or "priority" not in exc.message.lower():
                raise
            log.warning("vLLM does not schedule by priority (start it with --scheduling-policy priority, as "
                        "python -m app.vllm_server does): pre-warm still yields to users, at equal priority")
            self.priority = 0
            return await self._complete(messages, key)
