"""A bounded trie of recently served chunk-id sequences (the idea published as CacheWeaver, 2026).

Ordering a new request's selected set along the longest path already served makes its prompt share that
path's prefix, which vLLM probably still caches. Memory is bounded by pruning least-recently-used leaves;
all methods are thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any


class _Node:
    __slots__ = ("children", "last_used", "parent", "key")

    def __init__(self, parent: _Node | None, key: str | None) -> None:
        self.children: dict[str, _Node] = {}
        self.last_used = 0
        self.parent, self.key = parent, key


class ServedTrie:
    def __init__(self, max_nodes: int = 50_000) -> None:
        self.max_nodes = max_nodes
        self.root = _Node(None, None)
        self.nodes = 0
        self._clock = itertools.count(1)
        self._lock = threading.Lock()

    def order(self, ids: set[str]) -> list[str]:
        """The longest served path made only of ``ids`` (most recently used branch first at each step)."""
        with self._lock:
            node, path, remaining = self.root, list[str](), set(ids)
            while remaining:
                options = [node.children[i] for i in remaining if i in node.children]
                if not options:
                    break
                node = max(options, key=lambda child: child.last_used)
                path.append(node.key or "")  # every node below the root has a key
                remaining.discard(node.key)
            return path

    def insert(self, sequence: list[str]) -> None:
        with self._lock:
            now, node = next(self._clock), self.root
            for key in sequence:
                child = node.children.get(key)
                if child is None:
                    child = node.children[key] = _Node(node, key)
                    self.nodes += 1
                child.last_used = now
                node = child
            if self.nodes > self.max_nodes:
                self._prune(int(self.max_nodes * 0.9))

    def _prune(self, target: int) -> None:
        # Evict least-recently-used leaves until under target (a parent may become a leaf and go next round).
        while self.nodes > target:
            leaves = sorted(self._leaves(), key=lambda n: n.last_used)
            for leaf in leaves[: self.nodes - target]:
                del leaf.parent.children[leaf.key]
                self.nodes -= 1

    def _leaves(self) -> Iterator[Any]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root and not node.children:
                yield node
            stack.extend(node.children.values())
