"""Question -> ranked chunks: dense (embeddings, Chroma), lexical (BM25, ``app.core.lexical``) or both fused by
reciprocal rank. The collection and its derived indexes are ``CollectionIndex``'s; ranking runs on its worker
threads, never on the event loop."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from app.core.lexical import LexicalIndex
from app.core.records import row_text
from app.core.settings import ChromaSettings, PageSettings, RetrievalSettings
from app.rag.context import ContextChunk
from app.rag.index import CollectionIndex, to_chunk
from app.rag.seams import Embedder
from app.rag.vectors import QuestionVectors


@dataclass(frozen=True)
class Ranking:
    """A question's top chunks; ``complete`` is False when hybrid answered by the dense ranking alone because
    BM25 was still loading (after a start or a reload), or when a dense one was searched on the handle open before a
    reload: such a ranking is used once, not remembered."""

    chunks: list[ContextChunk]
    complete: bool = True


class Retriever:
    def __init__(self, index: CollectionIndex, embedder: Embedder, retrieval: RetrievalSettings,
                 encoders: int = 1) -> None:
        """``encoders``: question batches encoded at once (each on one of the index's worker threads)."""
        self.index, self.embedder, self.retrieval = index, embedder, retrieval
        self.vectors = QuestionVectors(embedder, index.run, encoders)  # concurrent questions, encoded in batches

    @classmethod
    def over(cls, embedder: Embedder, chroma: ChromaSettings, executor: ThreadPoolExecutor,
             retrieval: RetrievalSettings | None = None, paging: PageSettings | None = None) -> Retriever:
        """A retriever over its own ``CollectionIndex`` of the collection ``chroma`` names (scripts, tests)."""
        index = CollectionIndex(embedder, chroma, executor, retrieval, paging)
        return cls(index, embedder, index.retrieval)

    async def retrieve(self, question: str, k: int, source_prefix: str | None = None,
                       mode: str | None = None) -> list[ContextChunk]:
        return (await self.rank(question, k, source_prefix, mode)).chunks

    async def rank(self, question: str, k: int, source_prefix: str | None = None,
                   mode: str | None = None) -> Ranking:
        vector = await self.vectors.embed(question) if (mode or self.retrieval.mode) != "lexical" else None
        return await self.index.run(self.rank_sync, question, k, source_prefix, mode, vector)

    async def prime(self) -> None:
        """Load the vector index and run the encoder once (the first question would pay for both)."""
        await self.rank("prime the index", 1)

    def retrieve_sync(self, question: str, k: int, source_prefix: str | None = None,
                      mode: str | None = None) -> list[ContextChunk]:
        return self.rank_sync(question, k, source_prefix, mode).chunks

    def rank_sync(self, question: str, k: int, source_prefix: str | None = None,
                  mode: str | None = None, vector: list[float] | None = None) -> Ranking:
        """The top ``k`` chunks by ``mode`` (default: the configured one); ``vector``: the question's embedding,
        if already encoded. While the BM25 index is still being built (after a start or a reload), hybrid
        answers with the dense ranking alone rather than wait."""
        mode = mode or self.retrieval.mode
        where = self._where(source_prefix)
        if where == {"source": {"$in": []}}:
            return Ranking([])  # the filter matches no source at all
        lexical = self.index.lexical_index(wait=mode == "lexical") if mode != "dense" else None
        if lexical is None:  # a dense ranking made while a reload opens the store: used once, not remembered
            complete = mode == "dense" and not self.index.reopening
            return Ranking(self._dense(question, k, where, vector), complete=complete)
        if mode == "lexical":
            found = lexical.search(question, k, set(where["source"]["$in"]) if where else None)
            return Ranking(self.index.chunks([i for i, _ in found], [score for _, score in found]))
        asked = _Question(question, k, max(k, self.retrieval.candidates), where)
        return self._hybrid([asked], [self._vector(question, vector)], lexical)[0]

    def rank_batch_sync(self, questions: list[tuple[str, int, str | None]],
                        vectors: list[list[float] | None]) -> list[Ranking]:
        """``rank_sync`` of each ``(question, k, source_prefix)`` with its vector, the hybrid mode's work done
        once for them all: one Chroma query per depth and filter, one read of every fused chunk's text."""
        lexical = self.index.lexical_index(wait=False) if self.retrieval.mode == "hybrid" else None
        if lexical is None:  # dense or lexical alone, or BM25 still loading: nothing to share
            return [self.rank_sync(q, k, p, vector=v) for (q, k, p), v in zip(questions, vectors, strict=True)]
        asked = [_Question(q, k, max(k, self.retrieval.candidates), self._where(p)) for q, k, p in questions]
        return self._hybrid(asked, vectors, lexical)

    def _hybrid(self, asked: list[_Question], vectors: list[list[float] | None],
                lexical: LexicalIndex) -> list[Ranking]:
        """Dense and BM25 rankings fused by reciprocal rank; the texts read once, for the fused top k alone."""
        dense = self._dense_ids(asked, vectors)
        fused = [reciprocal_rank_fusion([ids, [i for i, _ in lexical.search(one.question, one.depth, one.sources)]],
                                        self.retrieval.rrf_k)[:one.k] if one.sources != set() else []
                 for one, ids in zip(asked, dense, strict=True)]
        rows = self.index.read(list({i for ranked in fused for i, _ in ranked}),  # deleted since: gone
                               {i for ids in dense for i in ids})
        return [Ranking([replace(chunk, rank=rank) for rank, chunk in enumerate(self.index.chunks(
                    [i for i, _ in ranked], [score for _, score in ranked], rows))]) for ranked in fused]

    def _dense_ids(self, asked: list[_Question], vectors: list[list[float] | None]) -> list[list[str]]:
        """Each question's dense ranking (ids only), one Chroma query per depth and filter."""
        ids: list[list[str]] = [[] for _ in asked]
        groups: dict[str, list[int]] = {}
        for n, one in enumerate(asked):
            groups.setdefault(repr((one.depth, one.where)), []).append(n)
        for group in groups.values():
            depth, where = asked[group[0]].depth, asked[group[0]].where
            if asked[group[0]].sources == set():
                continue
            found = self.index.query(query_embeddings=[vectors[n] for n in group], n_results=depth, where=where,
                                     include=[])
            for n, found_ids in zip(group, found["ids"], strict=True):
                ids[n] = found_ids
        return ids

    def _dense(self, question: str, k: int, where: dict[str, Any] | None,
               vector: list[float] | None) -> list[ContextChunk]:
        found = self.index.query(query_embeddings=[self._vector(question, vector)], n_results=k, where=where,
                                 include=["documents", "metadatas", "distances"])
        rows = zip(found["ids"][0], found["documents"][0], found["metadatas"][0], found["distances"][0])
        # A handle opened before another process deleted rows (a reload still opening the store) finds their ids
        # in its vector index with no row behind them: left out.
        present = [row for row in rows if row[2] is not None]
        return [to_chunk(chunk_id, row_text(meta, text), meta, 1.0 - distance, rank)
                for rank, (chunk_id, text, meta, distance) in enumerate(present)]

    def _vector(self, question: str, vector: list[float] | None) -> list[float]:
        """The question's embedding: the one given, else encoded now (scripts and tests that pass none)."""
        return vector if vector is not None else self.embedder.embed([question])[0]

    def _where(self, source_prefix: str | None) -> dict[str, Any] | None:
        if not source_prefix:
            return None
        return {"source": {"$in": [s for s in self.index.sources() if s.startswith(source_prefix)]}}


@dataclass(frozen=True)
class _Question:
    question: str
    k: int
    depth: int  # candidates each ranking contributes to the fusion
    where: dict[str, Any] | None  # the source filter, as Chroma takes it

    @cached_property
    def sources(self) -> set[str] | None:
        """The filter's sources as a set (BM25 takes them so); computed once, asked for several times."""
        return set(self.where["source"]["$in"]) if self.where else None


def reciprocal_rank_fusion(rankings: list[list[str]], k: int) -> list[tuple[str, float]]:
    """Ids by the sum over rankings of 1 / (k + rank); ties by id, so the order is the same on every run."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, chunk_id in enumerate(ranking, start=1):
            scores[chunk_id] = scores.get(chunk_id, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda item: (-item[1], item[0]))
