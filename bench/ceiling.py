"""The offline ceiling: the hit rate an infinite, block-granular prefix cache would give for exactly these
prompt token streams, in this order, after the same pre-warm prompts. Blocks are hashed in a chain (each hash covers all tokens before it),
as vLLM does; at least one token of every prompt is always computed, so a prompt of n tokens can hit at most
(n - 1) // block full blocks."""

from __future__ import annotations

import hashlib


class BlockCacheCeiling:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[bytes] = set()
        self.hit_tokens = 0
        self.query_tokens = 0

    def prime(self, token_ids: list[int]) -> None:
        """A prompt that was in the cache before the stream (pre-warm): its blocks count as seen, not as queries."""
        parent = b""
        for block in range(len(token_ids) // self.block_size):
            chunk = token_ids[block * self.block_size:(block + 1) * self.block_size]
            parent = hashlib.sha256(parent + repr(chunk).encode()).digest()
            self.seen.add(parent)

    def add(self, token_ids: list[int]) -> int:
        """Account one prompt; return how many of its tokens an infinite cache would have served."""
        parent = b""
        hits, counting = 0, True
        for block in range((len(token_ids) - 1) // self.block_size):
            chunk = token_ids[block * self.block_size:(block + 1) * self.block_size]
            parent = hashlib.sha256(parent + repr(chunk).encode()).digest()
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
