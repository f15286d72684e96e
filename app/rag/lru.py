"""A small LRU for async loaders (retrievals of earlier chat turns, parent documents of units)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class AsyncLRU(Generic[V]):
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._epoch = 0

    async def get(self, key: Hashable, load: Callable[[], Awaitable[V]], keep: Callable[[V], bool] | None = None) -> V:
        """The value kept for ``key``, else ``load()``'s, kept unless ``keep(value)`` says no."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        epoch = self._epoch
        value = await load()
        # Not kept when cleared while loading (the value may predate the change) or when ``keep`` says no.
        if epoch != self._epoch or (keep is not None and not keep(value)):
            return value
        self._items[key] = value
        if len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()
        self._epoch += 1
