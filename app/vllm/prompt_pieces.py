"""Token ids of a prompt's context pieces (each unit or chunk as rendered), made once and reused; a prompt's ids
as the JSON they are sent in (``TokenPrompt``).

A prompt's head (``app.vllm.prompt_ids``) is shared only by the questions whose contexts open alike; the rest of
each prompt, its tail, was tokenized on every request, most of the prompt where questions seldom share their
opening units (SQuAD). Each piece a tail shows, a unit or chunk exactly as rendered, is tokenized once here; a
request then tokenizes only the text between its pieces (the template's markup, the question).

Exact or unused: a piece's ids are kept only after a tail composed with them equalled that tail tokenized whole
(the template opens and closes every piece with markup, where tokenizers split the text anyway); composed tails
are checked again now and then, and one disagreement turns pieces off until vLLM changes. Checks run in the
background, one at a time, never ahead of a request.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

PIECE_CHARS = 256  # shorter pieces stay in the text tokenized per request (a lookup would cost what it saves)
PIECES_BYTES = 64 << 20  # the known pieces' ids as JSON, at most (~6 bytes a token: ~11M tokens)
CHECK_EVERY = 64  # one composed tail in this many is checked again against the tail tokenized whole


def encode(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each text's ids, in one call into the tokenizer (the one way tails and pieces are tokenized here)."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def fragment(ids: list[int]) -> bytes:
    """Ids as a JSON array's inside (``b"1,2"``), for joining."""
    return orjson.dumps(ids)[1:-1]


class TokenPrompt:
    """A prompt as token ids, in the JSON it is sent as: its head's array serialised once, when the head was
    learnt (thousands of ids: turning them into Python ints and JSON for every request was most of the cost of
    sending one), joined with its tail's fragments."""

    __slots__ = ("json", "reused", "tokenized")

    def __init__(self, head_json: bytes, tail: list[bytes], reused: int = 0, tokenized: int = 0) -> None:
        """``head_json``: the head's ids as ``open_array`` makes them (never empty); ``tail``: the rest's ids as
        fragments (``prompt_pieces.fragment``; empty ones are skipped); the tail's pieces whose ids were
        ``reused`` and those ``tokenized`` with the rest."""
        self.json = b",".join([head_json, *filter(None, tail)]) + b"]"
        self.reused, self.tokenized = reused, tokenized

    @staticmethod
    def open_array(head_ids: list[int]) -> bytes:
        """A head's ids as a JSON array without its closing bracket (``b"[1,2"``), for tails to join."""
        return orjson.dumps(head_ids)[:-1]

    def ids(self) -> list[int]:
        return list(orjson.loads(self.json))


@dataclass
class Cut:
    """A tail and the pieces found in it, in order: (start, end, key, the ids' fragment when known)."""

    tail: str
    spans: list[tuple[int, int, bytes, bytes | None]] = field(default_factory=list)

    @property
    def reused(self) -> int:
        return sum(known is not None for *_, known in self.spans)

    @property
    def learns(self) -> bool:
        return any(known is None for *_, known in self.spans)

    def texts(self) -> list[str]:
        """What a request tokenizes: the text before, between and after the known pieces."""
        texts, at = [], 0
        for start, end, _, known in self.spans:
            if known is not None:
                texts.append(self.tail[at:start])
                at = end
        texts.append(self.tail[at:])
        return texts

    def fragments(self, text_ids: list[list[int]]) -> list[bytes]:
        """The tail's ids as fragments: ``text_ids`` (of ``texts()``) with the known pieces' between them."""
        known = [ids for *_, ids in self.spans if ids is not None]
        parts = [fragment(text_ids[0])]
        for ids, text in zip(known, text_ids[1:], strict=True):
            parts += [ids, fragment(text)]
        return parts


class Pieces:
    def __init__(self) -> None:
        self.known: OrderedDict[bytes, bytes] = OrderedDict()  # a piece's key -> its ids' fragment
        self.size = 0  # bytes of fragments kept
        self.on = True
        self.checking = False  # a check in flight (one at a time)
        self.generation = 0  # bumped when cleared: a check begun before keeps nothing
        self._composed = 0

    def clear(self) -> None:
        self.known.clear()
        self.size, self.on, self.generation = 0, True, self.generation + 1

    def cut(self, text: str, tail_start: int, pieces: Sequence[str]) -> Cut:
        """The tail ``text[tail_start:]`` and the pieces (in prompt order) found in it. Each is looked for from
        where the one before ended, so the whole search reads the prompt about once, however many pieces it
        shows; those in the head, before the tail, are passed over."""
        cut, at = Cut(text[tail_start:]), 0
        for piece in pieces:
            if len(piece) < PIECE_CHARS or (start := text.find(piece, at)) < 0:
                continue
            at = start + len(piece)
            if start < tail_start:
                continue
            key = hashlib.blake2b(piece.encode(), digest_size=16).digest()
            if (known := self.known.get(key)) is not None:
                self.known.move_to_end(key)
            cut.spans.append((start - tail_start, at - tail_start, key, known))
        return cut

    def claim_check(self, cut: Cut) -> bool:
        """Whether this request's cut is checked in the background (the caller then runs the check and clears
        ``checking``): it shows new pieces, or it is composed and its turn to be checked again has come; never
        while another check runs."""
        if not self.on or self.checking:
            return False
        composed = cut.reused > 0
        if composed:
            self._composed += 1
        self.checking = cut.learns or (composed and self._composed % CHECK_EVERY == 1)
        return self.checking

    def keep(self, learnt: list[tuple[bytes, bytes]], generation: int) -> None:
        if generation != self.generation or not self.on:
            return
        for key, ids in learnt:
            if key not in self.known:
                self.known[key] = ids
                self.size += len(ids)
        while self.size > PIECES_BYTES and self.known:
            self.size -= len(self.known.popitem(last=False)[1])

    def turn_off(self) -> None:
        self.known.clear()
        self.size, self.on = 0, False


def check(tokenizer: Any, cut: Cut) -> list[tuple[bytes, bytes]] | None:
    """The new pieces' (key, fragment) if ``cut.tail`` composed from every piece found in it, known or new,
    equals the tail tokenized whole; None if not. Background work (a whole tail tokenized)."""
    tail, at, runs, pieces = cut.tail, 0, [], []
    for start, end, key, known in cut.spans:
        runs.append(tail[at:start])
        pieces.append((key, known, tail[start:end]))
        at = end
    runs.append(tail[at:])
    whole, *run_ids = encode(tokenizer, [tail, *runs])
    new_ids = iter(encode(tokenizer, [text for _, known, text in pieces if known is None]))
    composed, learnt = list(run_ids[0]), []
    for (key, known, _), run in zip(pieces, run_ids[1:], strict=True):
        if known is None:
            ids = next(new_ids)
            learnt.append((key, fragment(ids)))
        else:
            ids = orjson.loads(b"[" + known + b"]")
        composed += ids + run
    return learnt if composed == whole else None
