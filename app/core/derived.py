"""What a writer leaves beside the collection after changing it: the BM25 index, the pages and the inventory of
its documents, each stamped with the collection's generation and row count (``app.core.lexical``,
``app.core.pages``, ``app.core.inventory``).

Each is built from every row of the collection. Whatever is stale (all three after a run that wrote) is built from
one read of the rows, a page at a time, tokenized and summed as the pages arrive: a large collection is read once,
not once per index, and its texts are never all held at once. A run that begins on an empty collection reads
nothing back: its writes feed the builders as each lands (``Builders``), while the encoder embeds the next batch.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.core import inventory, lexical, pages
from app.core.seams import Collection
from app.core.settings import ChromaSettings, PageSettings
from app.core.store import all_rows, stamp_of


class RowsBuilder(Protocol):
    def add(self, rows: dict[str, Any]) -> None: ...


class Builders:
    """The three builders, fed a page of rows at a time: by one read of the collection, or, during a run, with
    every row ingest writes as each write lands (on the writer's thread). Fed by a run, they hold the collection's
    whole content only when it began empty and wrote each row once (``cover``); rows come in the order they were
    written, the order a read returns them in, so the indexes are those a read would build."""

    def __init__(self, paging: PageSettings) -> None:
        self.terms = lexical.LexicalRows()
        self.parents = pages.ParentSums() if paging.tokens else None  # pages off (0 tokens): no vectors
        self.documents = inventory.DocumentRows()
        self.ids: set[str] = set()
        self.rows = 0

    def add(self, rows: dict[str, Any]) -> None:
        """One write's rows (ids, embeddings, metadatas: each row's text in its metadata)."""
        page = rows | {"documents": [None] * len(rows["ids"])}
        for builder in (self.terms, self.parents, self.documents):
            if builder is not None:
                builder.add(page)
        self.ids.update(rows["ids"])
        self.rows += len(rows["ids"])

    def cover(self, collection: Collection) -> bool:
        """Every row of the collection fed, each once (no row written twice, none there before or deleted)."""
        return self.rows == len(self.ids) == collection.count()


def save_current(collection: Collection, cfg: ChromaSettings, paging: PageSettings,
                 generation: str | None = None, written: Builders | None = None) -> None:
    """Save the BM25 index, the pages and the inventory for the collection as it is now, rebuilding only what is
    stale (the caller holds the write lock: ingest at the end of a run, the documents API after a delete).
    ``generation``: save them under the stamp the writer is about to publish (``mark_changed``), so that a
    service reloading on it finds them saved instead of building its own from every row. ``written``: the rows
    the run fed as it wrote them; where they are the whole collection, nothing is read."""
    stamp = (generation, collection.count()) if generation else stamp_of(collection)
    folder, path, listed = lexical.index_dir(cfg), pages.path_of(cfg), inventory.path_of(cfg)
    saved_pages = pages.load(path)  # the previous pages: a document keeps its page
    fed = written if written is not None and written.cover(collection) else None
    fresh = fed or Builders(paging)  # else empty, filled by one read of the rows below
    terms = fresh.terms if lexical.saved_stamp(folder) != stamp else None
    stale_pages = saved_pages is None or saved_pages.stamp != (*stamp, paging.tokens)
    parents = fresh.parents if stale_pages else None
    documents = fresh.documents if inventory.recorded_stamp(listed) != stamp else None
    built: list[tuple[RowsBuilder | None, list[str]]] = [
        (terms, lexical.ROWS_READ), (parents, pages.ROWS_READ), (documents, inventory.ROWS_READ)]
    builders = [(builder, reads) for builder, reads in built if builder is not None]
    if builders and fed is None:
        for rows in all_rows(collection, sorted({field for _, reads in builders for field in reads})):
            for builder, _ in builders:
                builder.add(rows)
    if terms is not None:
        lexical.save(terms.index(stamp[0]), folder)
    if stale_pages:
        sums = parents.parents() if parents is not None else None
        pages.save(pages.build_from(sums, stamp, paging.tokens, saved_pages), path)
    if documents is not None:
        inventory.save(documents.documents, stamp, listed)
