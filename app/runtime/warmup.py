"""Pre-warm: put what requests will ask for into vLLM's prefix cache before they ask, without ever delaying
one. The lifespan owns one ``Warmer``; it starts when vLLM (re)appears or the collection changes, asks the
planner for a plan (``ContextPlanner.warm_plan``) and sends it in the background: every warm-up request gives
way to user traffic (``app.runtime.background``: while users are present, a bounded share runs only where vLLM
has room) and is sent at a lower vLLM priority; the whole run is bounded by time and by an absolute token budget
besides a KV share. Readiness never waits for it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from app.core.errors import BadRequest, ContextTooLong, ServiceError, StoreUnavailable
from app.core.settings import WarmupSettings
from app.rag.affinity import affinity_key
from app.rag.budget import TokenEstimator
from app.rag.planner import ContextPlanner, WarmPlan, WarmUnit
from app.rag.seams import LLM
from app.runtime.background import Background
from app.runtime.traffic import LiveTraffic
from app.runtime.upstream import Upstream
from app.vllm.prompt_ids import PromptIds
from app.vllm.wire import UpstreamInfo

log = logging.getLogger("prefixrag.warmup")


@dataclass
class WarmupProgress:
    state: str = "waiting for vLLM"  # waiting for vLLM | warming | done | stopped: <why> | interrupted: <why>
    prefix_tokens: int = 0  # the stable prefix (system prompt): warmed first
    units_planned: int = 0
    units_warmed: int = 0
    units_kept: int = 0  # of those warmed: unchanged since this process warmed them for this vLLM, not sent again
    units_too_long: int = 0  # planned units vLLM refused as longer than its window (a request trims them anyway)
    tokens: int = 0  # prompt tokens this warm-up sent, or kept (``units_kept``), all of it
    token_budget: int = 0
    seconds: float = 0.0
    corpus_chunks: int | None = None
    corpus_read: int | None = None  # chunks read to decide whether the corpus fits (fewer: it could not)
    corpus_tokens: int | None = None  # counted only when the estimate came near the window
    corpus_fits: bool | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"


class Warmer:
    def __init__(self, settings: WarmupSettings, planner: ContextPlanner, llm: LLM, estimator: TokenEstimator,
                 upstream: Upstream, traffic: LiveTraffic, prompt_ids: PromptIds,
                 background: Background | None = None) -> None:
        """``background``: another collection's, whose bounds this pre-warm shares (else its own)."""
        self.settings, self.planner, self.llm, self.estimator = settings, planner, llm, estimator
        self.prompt_ids = prompt_ids  # a warmed unit's prompt head is learnt: its first question goes as token ids
        self.upstream = upstream
        self.background = background or Background(traffic, settings.beside_users, settings.concurrency)
        self.progress = WarmupProgress()
        self.priority = settings.priority  # dropped (0) if vLLM does not schedule by priority
        # What is cached now, with each prompt's routing key (benchmarks prime their ceiling with it and replay it).
        self.warmed_prompts: list[tuple[list[dict[str, Any]], str]] = []
        # Each unit warmed for the vLLM up now (its whole prompt's digest, its key) -> its prompt tokens: after an
        # ingest, a unit that did not change is not sent again (forgotten when vLLM restarts, its cache empty).
        self._warm: dict[tuple[str, str], int] = {}
        self._kick = asyncio.Event()
        self._run: asyncio.Task[WarmupProgress] | None = None
        self._started = 0.0

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
                if appeared.is_set():  # vLLM (re)started: nothing is cached there
                    self._warm.clear()
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
        """One whole warm-up: the planner decides and plans, then the stable prefix and the units are sent."""
        self.progress, self.warmed_prompts, self._started = WarmupProgress(state="warming"), [], time.monotonic()
        # Both tiers: what the GPU's cache evicts to host memory stays warm there (app.vllm.kv_tiers).
        self.progress.token_budget = min(int((info.kv_cache_tokens + info.host_kv_tokens) * self.settings.kv_share),
                                         self.settings.max_tokens)
        with self.background.reads():
            await self._warm_all(info)
        self.progress.seconds = round(time.monotonic() - self._started, 3)
        log.info("pre-warm %s: %d/%d units, %d tokens in %.1fs", self.progress.state, self.progress.units_warmed,
                 self.progress.units_planned, self.progress.tokens, self.progress.seconds)
        return self.progress

    async def _warm_all(self, info: UpstreamInfo) -> None:
        try:
            plan = await self.planner.warm_plan(info, self.settings.piece_tokens)
            if plan.verdict is not None:
                verdict = plan.verdict
                self.progress.corpus_chunks, self.progress.corpus_tokens = verdict.chunks, verdict.tokens
                self.progress.corpus_read, self.progress.corpus_fits = verdict.read, verdict.fits
            self.progress.prefix_tokens = await self._send(plan.prefix, affinity_key([]))
            await self.prompt_ids.learn(plan.prefix, plan.prefix_lead)  # the head of contexts opening with a hit
            await self._warm_units(plan)
            if self.progress.state == "warming":
                self.progress.state = "done"
        except StoreUnavailable as exc:  # the collection watcher restarts us when it is back
            self.progress.state = f"interrupted: the collection is unavailable ({exc.message})"
        except ServiceError as exc:  # vLLM went away: it is re-warmed when the monitor sees it back
            self.progress.state = f"interrupted: {exc.message}"
        except Exception as exc:  # a bug must not leave "warming" on /readyz forever, nor pass unseen
            log.exception("pre-warm failed")
            self.progress.state = f"failed: {type(exc).__name__}: {exc}"

    async def _warm_units(self, plan: WarmPlan) -> None:
        """Send the plan's units in order, ``warm_concurrency`` at a time, until it ends or a bound stops it."""
        taking = asyncio.Lock()  # one worker at a time reads the plan (an async generator)

        async def next_unit() -> WarmUnit | None:
            async with taking:
                unit = await anext(plan.units, None)
                self.progress.units_planned = plan.planned
                return unit

        async def worker() -> None:
            while self._within_bounds() and (unit := await next_unit()) is not None:
                await self._warm_unit(unit)

        await asyncio.gather(*(worker() for _ in range(self.settings.concurrency)))
        self.progress.units_planned = plan.planned

    async def _warm_unit(self, unit: WarmUnit) -> None:
        """Send one unit piece by piece, unless it was warmed before as it is now (kept) or is too long."""
        signature = (hashlib.blake2b(json.dumps(unit.pieces[-1]).encode()).hexdigest(), unit.affinity)
        if (kept := self._warm.get(signature)) is not None:
            self._kept(unit, kept)
            return
        try:
            for number, piece in enumerate(unit.pieces, 1):
                tokens = await self._send(piece, unit.affinity, whole=number == len(unit.pieces))
        except ContextTooLong as exc:  # one unit, not the warm-up: the others still fit
            self._too_long(unit, exc)
            return
        self._warm[signature] = tokens
        self.progress.units_warmed += 1
        await self.prompt_ids.learn(unit.pieces[-1], unit.lead)  # returns at once where token-id prompts are off

    def _too_long(self, unit: WarmUnit, exc: ContextTooLong) -> None:
        """A unit whose prompt the window cannot hold (its size was estimated from characters, and this text has
        fewer per token): skipped; a question about it gets the unit's best chunks that fit, as every prompt does."""
        self.progress.units_too_long += 1
        if self.progress.units_too_long == 1:
            log.warning("pre-warm skips unit %s, longer than vLLM's window: %s (further ones counted on /readyz)",
                        unit.key, exc.message)

    def _kept(self, unit: WarmUnit, tokens: int) -> None:
        """A unit warmed before, unchanged: counted as warm, not sent (what evicted it since, if anything, was
        users' traffic, which vLLM's LRU cache favours)."""
        self.warmed_prompts.append((unit.pieces[-1], unit.affinity))
        self.progress.tokens += tokens
        self.progress.units_warmed += 1
        self.progress.units_kept += 1

    def _within_bounds(self) -> bool:
        """True while pre-warm may send more; else it records which bound stopped it."""
        if self.progress.tokens >= self.progress.token_budget:
            return self._stopped(f"token budget ({self.progress.token_budget})")
        if time.monotonic() - self._started >= self.settings.max_s:
            return self._stopped(f"time budget ({self.settings.max_s:g} s)")
        return True

    def _stopped(self, why: str) -> bool:
        if self.progress.state == "warming":
            self.progress.state = f"stopped: {why}"
        return False

    async def _send(self, messages: list[dict[str, Any]], key: str, whole: bool = True) -> int:
        """One warm-up request (1 output token), yielding to users, routed like the requests that will use its
        prefix (``key``); returns the prompt tokens vLLM counted. A piece (not ``whole``) only prepares the
        cache for the next one and is not counted."""
        response = await self.background.yielding(lambda: self._complete(messages, key))
        tokens: int = response.usage.prompt_tokens  # vLLM counted the prompt it just cached: no /tokenize
        self.estimator.observe(messages, tokens)
        if not whole:
            return tokens
        self.warmed_prompts.append((messages, key))
        self.progress.tokens += tokens
        return tokens

    async def _complete(self, messages: list[dict[str, Any]], key: str) -> Any:
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
