"""The lexical (BM25) index of a collection, kept beside it.

It is built from the collection's own rows (ids, texts, sources) and stamped with the collection's generation
and row count, so it holds exactly the collection's ids: ingest rebuilds it after every run that changed the
collection (a run killed mid-way leaves the stamp behind, and the next run rebuilds); a service that finds the
stamp differs builds its own copy in memory from Chroma. Only writers save it, under the write lock
(``app.core.derived``: ingest, the documents API's delete).
Scoring is bm25s (Lucene BM25) over lower-cased words, English stop words removed, Snowball-stemmed; words
joined by underscores (``sys_path_init``) stay one token, so identifiers match exactly. Top-k selection is numpy's,
whatever else is installed (see ``_bm25s``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from app.core.records import ChunkRecord, row_text
from app.core.seams import Collection
from app.core.settings import ChromaSettings
from app.core.store import all_rows, derived_dir, stamp_of

META = "prefixrag-lexical.json"
STAMP = "prefixrag-lexical-stamp.json"  # the stamp alone: checked without reading the ids, sources and scores
ROWS_READ = ["documents", "metadatas"]  # what building the index reads of each row
_per_thread = threading.local()


def index_dir(cfg: ChromaSettings) -> Path:
    return derived_dir(cfg, "lexical")


def _bm25s() -> Any:
    """bm25s, kept off the GPU. Where jax is installed (common on GPU machines), importing bm25s imports jax and
    runs a top-k, and jax then claims 75 % of the GPU's memory (vLLM's, on a serving machine; measured on an H200:
    "Failed to allocate 14.16GiB" beside vLLM, every query's selection then a jax dispatch beside vLLM's kernels).
    So jax, if present, gets the CPU unless told otherwise, and ``search`` selects with numpy."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import bm25s

    return bm25s


def tokenize(texts: list[str]) -> list[list[str]]:
    return list(_bm25s().tokenize(texts, stopwords="en", stemmer=_stemmer(), return_ids=False, show_progress=False))


def _stemmer() -> Any:
    """One per thread (PyStemmer's stemmers are not thread-safe), built once: every question is tokenized on the
    request path."""
    import Stemmer

    if not hasattr(_per_thread, "stemmer"):
        _per_thread.stemmer = Stemmer.Stemmer("english")
    return _per_thread.stemmer


@dataclass
class LexicalIndex:
    generation: str
    ids: list[str]
    sources: list[str]
    bm25: Any  # bm25s.BM25

    @property
    def stamp(self) -> tuple[str, int]:
        return self.generation, len(self.ids)

    @cached_property
    def distinct_sources(self) -> list[str]:
        """Every source the collection holds, sorted (prefix filters pick from it without reading Chroma)."""
        return sorted(set(self.sources))

    @cached_property
    def _source_codes(self) -> tuple[dict[str, int], np.ndarray]:
        """Each distinct source's number and every chunk's: a filter's mask is one vector operation."""
        numbers = {source: n for n, source in enumerate(self.distinct_sources)}
        return numbers, np.fromiter((numbers[s] for s in self.sources), dtype=np.int32, count=len(self.sources))

    def _mask(self, sources: set[str]) -> np.ndarray:
        numbers, codes = self._source_codes
        return np.isin(codes, [numbers[s] for s in sources if s in numbers]).astype(np.float32)

    def search(self, question: str, k: int, sources: set[str] | None = None) -> list[tuple[str, float]]:
        """Up to ``k`` (chunk id, BM25 score) best first, only chunks sharing a word with the question and,
        with ``sources``, only from those sources (the same filter the dense search applies)."""
        if not self.ids or k < 1:
            return []
        tokens = tokenize([question])[0]
        if not tokens:
            return []
        scores = self.bm25.get_scores(tokens, weight_mask=None if sources is None else self._mask(sources))
        return [(self.ids[i], float(scores[i])) for i in best(scores, k)]


def best(scores: np.ndarray, k: int) -> np.ndarray:
    """The indices of the ``k`` highest positive scores, best first, ties in index order. Chosen among the positive
    scores alone: most of a large corpus scores 0 for a question, and a partition over all of them (bm25s's own
    numpy selection) costs many times the scoring itself (``bench.lexical_search`` has the figures)."""
    scored = np.flatnonzero(scores > 0)
    if len(scored) > k:
        kth = np.partition(scores[scored], -k)[-k]
        scored = scored[scores[scored] >= kth]
    ranked: np.ndarray = scored[np.lexsort((scored, -scores[scored]))]
    return ranked[:k]


class LexicalRows:
    """Rows taken a page at a time and tokenized as they come (one pass over the collection may feed other
    indexes too): the texts themselves are not kept."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.tokens: list[list[str]] = []
        self.sources: list[str] = []

    def add(self, rows: dict[str, Any]) -> None:
        self.ids += rows["ids"]
        texts = [row_text(meta, text) for meta, text in zip(rows["metadatas"], rows["documents"], strict=True)]
        self.tokens += tokenize(texts) if texts else []
        self.sources += [ChunkRecord.from_metadata(meta).source for meta in rows["metadatas"]]

    def index(self, generation: str) -> LexicalIndex:
        bm25 = _bm25s().BM25()
        if self.tokens:
            bm25.index(self.tokens, show_progress=False)
        return LexicalIndex(generation, self.ids, self.sources, bm25)


def build(collection: Collection) -> LexicalIndex:
    """Read every row of the collection (a page at a time) and index it."""
    generation, _ = stamp_of(collection)
    rows = LexicalRows()
    for page in all_rows(collection, ROWS_READ):
        rows.add(page)
    return rows.index(generation)


def save(index: LexicalIndex, folder: Path) -> None:
    """Write to a new folder, then swap it in: a reader finds the old index or the new one, never half of one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:8]}")
    if index.ids:
        index.bm25.save(str(fresh), show_progress=False)
    fresh.mkdir(parents=True, exist_ok=True)
    (fresh / META).write_text(json.dumps({"generation": index.generation, "ids": index.ids,
                                          "sources": index.sources}))
    (fresh / STAMP).write_text(json.dumps(list(index.stamp)))
    old = folder.with_name(f".{folder.name}.old-{uuid.uuid4().hex[:8]}")
    if folder.exists():
        folder.rename(old)
    fresh.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def load(folder: Path) -> LexicalIndex | None:
    """The saved index, or None where there is none (or it cannot be read: it is rebuilt then)."""
    bm25s = _bm25s()
    try:
        meta = json.loads((folder / META).read_text())
        # Memory-mapped: the app and each ranking worker share one copy of the scores in the page cache (a
        # search reads them as fast; ingest swaps in a new folder, and a mapping of the old one stays valid).
        bm25 = bm25s.BM25.load(str(folder), mmap=True, show_progress=False) if meta["ids"] else bm25s.BM25()
    except (OSError, ValueError, KeyError):
        return None
    return LexicalIndex(meta["generation"], meta["ids"], meta["sources"], bm25)


def saved_stamp(folder: Path) -> tuple[str, int] | None:
    """The saved index's stamp, its ids, sources and scores not read (None: no index saved)."""
    try:
        generation, count = json.loads((folder / STAMP).read_text())
        return str(generation), int(count)
    except (OSError, ValueError, TypeError):
        saved = load(folder)  # saved before the stamp had a file of its own
        return saved.stamp if saved is not None else None


def current(collection: Collection, cfg: ChromaSettings) -> LexicalIndex:
    """The index matching the collection as it is now: the saved one if its stamp matches, else built afresh in
    memory (a writer saves it: ``app.core.derived``); a stale saved one is never loaded."""
    folder, stamp = index_dir(cfg), stamp_of(collection)
    if saved_stamp(folder) == stamp and (saved := load(folder)) is not None and saved.stamp == stamp:
        return saved  # checked again: a writer may have swapped in another between the two reads
    return build(collection)
