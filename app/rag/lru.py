"""A small LRU for async loaders (retrievals of earlier chat turns, parent documents of units), with one load per
key at a time: requests that need the same value at once (a big parent document every question about it needs
after an ingest made the service forget it) wait for one load instead of each reading it again."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class AsyncLRU(Generic[V]):
    def __init__(self, size: int, lane: Callable[[], Hashable] = lambda: None) -> None:
        """``lane()``: who is asking, read in the caller's context; only callers of one lane share a load (a
        user's request never waits on a load that background work started, which may yield to users)."""
        self.size, self.lane = size, lane
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._loading: dict[tuple[Hashable, Hashable], asyncio.Task[V]] = {}
        self._epoch = 0

    async def get(self, key: Hashable, load: Callable[[], Awaitable[V]], keep: Callable[[V], bool] | None = None) -> V:
        """The value kept for ``key``, else ``load()``'s (or that of a load of ``key`` already running in this
        lane), kept unless ``keep(value)`` says no. A caller cancelled while waiting leaves the load running for
        the others."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        slot = (key, self.lane())
        task = self._loading.get(slot)
        if task is None:
            task = asyncio.ensure_future(self._load(slot, load, keep))
            task.add_done_callback(_retrieved)  # its error is raised to each caller waiting; none may be left
            self._loading[slot] = task
        return await asyncio.shield(task)

    async def _load(self, slot: tuple[Hashable, Hashable], load: Callable[[], Awaitable[V]],
                    keep: Callable[[V], bool] | None) -> V:
        epoch = self._epoch
        try:
            value = await load()
        finally:
            if self._loading.get(slot) is asyncio.current_task():
                del self._loading[slot]
        # Not kept when cleared while loading (the value may predate the change) or when ``keep`` says no.
        if epoch != self._epoch or (keep is not None and not keep(value)):
            return value
        self._items[slot[0]] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def cached(self, key: Hashable) -> V | None:
        """The value kept for ``key`` (None: none kept), without loading it or marking it used."""
        return self._items.get(key)

    def clear(self) -> None:
        """Forget every value; a load running now is not joined by later callers, nor kept."""
        self._items.clear()
        self._loading.clear()
        self._epoch += 1


def _retrieved(task: asyncio.Task[object]) -> None:
    if not task.cancelled():
        task.exception()
