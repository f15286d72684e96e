"""The offline ceiling: the hit rate an infinite, block-granular prefix cache would give for exactly these
prompt token streams, in this order, after the same pre-warm prompts. Blocks are hashed in a chain (each hash
covers all tokens before it), as vLLM does; at least one token of every prompt is always computed, so a prompt
of n tokens can hit at most (n - 1) // block full blocks."""

from __future__ import annotations

import hashlib


class BlockCacheCeiling:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[bytes] = set()
        self.hit_tokens = 0
        self.query_tokens = 0

    def _chained_hashes(self, token_ids: list[int], blocks: int):
        parent = b""
        for block in range(blocks):
            chunk = token_ids[block * self.block_size:(block + 1) * self.block_size]
            parent = hashlib.sha256(parent + repr(chunk).encode()).digest()
            yield parent

    def prime(self, token_ids: list[int]) -> None:
        """A prompt that was in the cache before the stream (pre-warm): its blocks count as seen, not as queries."""
        self.seen.update(self._chained_hashes(token_ids, len(token_ids) // self.block_size))

    def add(self, token_ids: list[int]) -> int:
        """Account one prompt; return how many of its tokens an infinite cache would have served."""
        hits, counting = 0, True
        for parent in self._chained_hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            if counting and parent in self.seen:
                hits += self.block_size
            else:
                counting = False
            self.seen.add(parent)
        self.hit_tokens += hits
        self.query_tokens += len(token_ids)
        return hits

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
