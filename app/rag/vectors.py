"""Question embeddings for concurrent requests, encoded together: every question waiting when an encoder call
frees up goes into one batch, one forward pass instead of one each (far cheaper per question on a CPU). A lone
question is encoded at once (no wait for company); under load the batches grow with the queue. At most
``parallel`` batches run at once, each on a worker thread."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from app.rag.seams import Embedder

MAX_BATCH = 64  # questions per forward pass: more would only make the first of them wait longer


class QuestionVectors:
    def __init__(self, embedder: Embedder, run: Callable[..., Awaitable[Any]], parallel: int = 1) -> None:
        """``run(work, *args)``: where the encoder runs (a worker thread, never the event loop)."""
        self.embedder, self.run, self.parallel = embedder, run, parallel
        self._pending: list[tuple[str, asyncio.Future[list[float]]]] = []
        self._encoders: set[asyncio.Task[None]] = set()

    async def embed(self, question: str) -> list[float]:
        vector: asyncio.Future[list[float]] = asyncio.get_running_loop().create_future()
        self._pending.append((question, vector))
        if len(self._encoders) < self.parallel:
            self._encoders.add(asyncio.create_task(self._encode_pending(), name="question-vectors"))
        return await vector

    async def _encode_pending(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                try:
                    vectors = await self.run(self.embedder.embed, [question for question, _ in batch])
                except Exception as exc:  # every question of the batch fails as its own request would have
                    for _, vector in batch:
                        if not vector.done():
                            vector.set_exception(exc)
                    continue
                for (_, vector), found in zip(batch, vectors):
                    if not vector.done():  # its request may have gone meanwhile
                        vector.set_result(found)
        finally:
            # Here, not in a done callback: that runs a loop turn later, and a question asked in between (its
            # caller resumed by the last result) would find this encoder still counted and wait for nothing.
            self._encoders.discard(asyncio.current_task())
