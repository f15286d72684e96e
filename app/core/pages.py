"""Pages: small documents grouped into stable, prompt-sized units of related documents.

A parent document much smaller than a prompt's context (an abstract, a FAQ entry, a short file) makes a poor
cached unit on its own: a question's other hits fall elsewhere and its prompt is mostly uncached text. Grouped
by meaning into pages of about ``PageSettings.tokens``, the hits of one question tend to share a page, and the
page is one cached prefix that every question about any of its documents reuses.

Grouping: each small parent is the mean of its chunks' embeddings; the set is split by k-means (into as many parts
as pages it needs, up to ``SPLIT_WAYS``) again and again until every group fits a page, and the leaves, in tree
order (neighbours are related), are packed into pages. Deterministic: the same rows give the same pages. On a
rebuild the previous pages are kept: a document stays in its page, a gone one leaves it, a new one joins the page
nearest to it with room, and only what fits nowhere is grouped into new pages -- a re-ingest moves no document
between pages.

Kept beside the collection like the BM25 index and stamped the same way (generation, row count, page size):
ingest writes it after a run, a service whose stamp differs rebuilds it in memory (from the saved pages).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.core.records import ChunkRecord, row_text
from app.core.seams import Collection
from app.core.settings import ChromaSettings, PageSettings
from app.core.store import all_rows, derived_dir, stamp_of

CHARS_PER_TOKEN = 4.0  # rough chars per LLM token: sizes here only decide what is small and what fits a page
SMALL_SHARE = 0.5  # a parent is paged when it is at most this share of a page
ROWS_READ = ["embeddings", "metadatas", "documents"]  # what building pages reads of each row
SPLIT_WAYS = 4  # a group too big for a page is split into at most this many parts at once: fewer k-means runs
FIT_SAMPLE = 2048  # a bigger group's k-means is fitted on a seeded sample of this many of its rows, then all assigned


@dataclass
class PageIndex:
    generation: str
    count: int
    tokens: int  # the page size it was built for (0: paging off)
    pages: dict[str, list[str]] = field(default_factory=dict)  # page key -> its parents, in page order

    def __post_init__(self) -> None:
        self._page_of = {parent: key for key, members in self.pages.items() for parent in members}

    @property
    def stamp(self) -> tuple[str, int, int]:
        return self.generation, self.count, self.tokens

    def page_of(self, parent: str) -> str | None:
        return self._page_of.get(parent)


@dataclass
class Parents:
    """The collection's parent documents: key, estimated tokens, unit-length mean embedding."""

    keys: list[str]
    tokens: np.ndarray
    vectors: np.ndarray


class ParentSums:
    """Parents accumulated a page of rows at a time (one pass over the collection may feed other indexes too)."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.chars: dict[str, int] = {}

    def add(self, rows: dict[str, Any]) -> None:
        for vector, meta, text in zip(rows["embeddings"], rows["metadatas"], rows["documents"]):
            parent = ChunkRecord.from_metadata(meta).parent_key
            self.sums[parent] = self.sums.get(parent, 0.0) + np.asarray(vector, dtype=np.float64)
            self.chars[parent] = self.chars.get(parent, 0) + len(row_text(meta, text))

    def parents(self) -> Parents:
        keys = sorted(self.sums)
        vectors = np.array([self.sums[k] for k in keys]) if keys else np.zeros((0, 1))
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return Parents(keys, np.array([self.chars[k] / CHARS_PER_TOKEN for k in keys]), vectors)


def read_parents(collection: Collection) -> Parents:
    sums = ParentSums()
    for rows in all_rows(collection, ROWS_READ):
        sums.add(rows)
    return sums.parents()


def group(vectors: np.ndarray, tokens: np.ndarray, limit: float) -> list[list[int]]:
    """Row indices grouped into pages of at most ``limit`` tokens (a row bigger than that alone)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):  # most splits are of a few hundred rows: a thread pool per call costs more than
        return _pack(_leaves(vectors, tokens, limit), tokens, limit)  # it saves (same pages either way)


def _leaves(vectors: np.ndarray, tokens: np.ndarray, limit: float) -> list[list[int]]:
    vectors = vectors.astype(np.float32)  # k-means in float32: faster, as good a grouping (bench.pages_group)
    sampling = np.random.default_rng(0)
    leaves, stack = [], [np.arange(len(tokens))] if len(tokens) else []
    while stack:  # depth-first, the part holding the group's first row first: leaves come out in tree order
        members = stack.pop()
        total = tokens[members].sum()
        if total <= limit or len(members) == 1:
            leaves.append(members.tolist())
            continue
        ways = min(SPLIT_WAYS, int(np.ceil(total / limit)), len(members))
        labels = _split(vectors[members], ways, sampling)
        parts = [members[labels == label] for label in np.unique(labels)]
        if len(parts) == 1:  # identical vectors: split in order
            parts = [members[:len(members) // 2], members[len(members) // 2:]]
        stack += sorted(parts, key=lambda part: part[0], reverse=True)
    return leaves


def _split(vectors: np.ndarray, ways: int, sampling: np.random.Generator) -> np.ndarray:
    """Each row's part among ``ways`` k-means clusters; past ``FIT_SAMPLE`` rows, fitted on a sample of them."""
    from sklearn.cluster import KMeans

    kmeans = KMeans(n_clusters=ways, n_init=3, random_state=0)
    fitted = vectors
    if len(vectors) > FIT_SAMPLE:
        fitted = vectors[sampling.choice(len(vectors), FIT_SAMPLE, replace=False)]
    labels: np.ndarray = kmeans.fit(fitted).predict(vectors)
    return labels


def _pack(leaves: list[list[int]], tokens: np.ndarray, limit: float) -> list[list[int]]:
    """Neighbouring leaves merged while they fit one page (a split leaves many groups far below a page)."""
    pages: list[list[int]] = []
    for leaf in leaves:
        if pages and tokens[pages[-1]].sum() + tokens[leaf].sum() <= limit:
            pages[-1] += leaf
        else:
            pages.append(list(leaf))
    return pages


def build(collection: Collection, size: int, previous: PageIndex | None = None) -> PageIndex:
    """Pages of about ``size`` tokens (0: none), keeping ``previous``'s where it was built for that size."""
    stamp = stamp_of(collection)
    return build_from(read_parents(collection) if size else None, stamp, size, previous)


def build_from(parents: Parents | None, stamp: tuple[str, int], size: int, previous: PageIndex | None) -> PageIndex:
    """``build`` from parents already read (``ParentSums``; None with paging off) for a collection of this stamp."""
    generation, count = stamp
    if not size or parents is None:
        return PageIndex(generation, count, size)
    small = {k: i for i, k in enumerate(parents.keys) if parents.tokens[i] <= SMALL_SHARE * size}
    kept = {key: [p for p in members if p in small]
            for key, members in (previous.pages.items() if previous and previous.tokens == size else [])}
    kept = {key: members for key, members in kept.items() if members}
    placed = {p for members in kept.values() for p in members}
    newcomers = [p for p in small if p not in placed]  # sorted: parents.keys is
    leftovers = _join_nearest(kept, newcomers, small, parents, size)
    rows = [small[p] for p in leftovers]
    fresh = group(parents.vectors[rows], parents.tokens[rows], size)
    number = 1 + max((int(key.rsplit("-", 1)[1]) for key in kept), default=0)
    for offset, members in enumerate(fresh):
        kept[f"page-{number + offset:05d}"] = [leftovers[i] for i in members]
    return PageIndex(generation, count, size, {key: kept[key] for key in sorted(kept)})


def _join_nearest(kept: dict[str, list[str]], newcomers: list[str], small: dict[str, int], parents: Parents,
                  limit: float) -> list[str]:
    """Each newcomer joins the existing page whose centroid is nearest, if it has room; the rest are returned."""
    if not kept or not newcomers:
        return newcomers
    keys = list(kept)
    centroids = np.array([parents.vectors[[small[p] for p in kept[k]]].mean(axis=0) for k in keys])
    sizes = [parents.tokens[[small[p] for p in kept[k]]].sum() for k in keys]
    leftovers = []
    for parent in newcomers:
        row = small[parent]
        nearest = int(np.argmax(centroids @ parents.vectors[row]))
        if sizes[nearest] + parents.tokens[row] <= limit:
            kept[keys[nearest]].append(parent)
            sizes[nearest] += parents.tokens[row]
        else:
            leftovers.append(parent)
    return leftovers


def path_of(cfg: ChromaSettings) -> Path:
    folder = derived_dir(cfg, "pages")
    return folder.with_name(f"{folder.name}.json")  # not with_suffix: collection names may hold dots


def save(index: PageIndex, path: Path) -> None:
    """Written whole to a temporary file, then renamed over the old one: a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fresh.write_text(json.dumps({"generation": index.generation, "count": index.count, "tokens": index.tokens,
                                 "pages": index.pages}))
    fresh.replace(path)


def load(path: Path) -> PageIndex | None:
    try:
        saved = json.loads(path.read_text())
        return PageIndex(saved["generation"], saved["count"], saved["tokens"], saved["pages"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def current(collection: Collection, cfg: ChromaSettings, settings: PageSettings) -> PageIndex:
    """The pages of the collection as it is now: the saved ones if their stamp matches, else rebuilt in memory
    from the saved ones (a writer saves them: ``app.core.derived``). The page size is ingest's choice: a service
    rebuilds with the size the saved pages were made for (``settings`` only where none were saved)."""
    saved = load(path_of(cfg))
    size = saved.tokens if saved is not None else settings.tokens
    if saved is not None and saved.stamp == (*stamp_of(collection), size):
        return saved
    return build(collection, size, previous=saved)
