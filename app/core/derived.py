"""What a writer leaves beside the collection after changing it: the BM25 index, the pages and the inventory of
its documents, each stamped with the collection's generation and row count (``app.core.lexical``,
``app.core.pages``, ``app.core.inventory``).

Each is built from every row of the collection. Whatever is stale (all three after a run that wrote) is built from
one read of the rows, a page at a time, tokenized and summed as the pages arrive: a large collection is read once,
not once per index, and its texts are never all held at once.
"""

from __future__ import annotations

from typing import Any, Protocol

from app.core import inventory, lexical, pages
from app.core.seams import Collection
from app.core.settings import ChromaSettings, PageSettings
from app.core.store import all_rows, stamp_of


class RowsBuilder(Protocol):
    def add(self, rows: dict[str, Any]) -> None: ...


def save_current(collection: Collection, cfg: ChromaSettings, paging: PageSettings,
                 generation: str | None = None) -> None:
    """Save the BM25 index, the pages and the inventory for the collection as it is now, rebuilding only what is
    stale (the caller holds the write lock: ingest at the end of a run, the documents API after a delete).
    ``generation``: save them under the stamp the writer is about to publish (``mark_changed``), so that a
    service reloading on it finds them saved instead of building its own from every row."""
    stamp = (generation, collection.count()) if generation else stamp_of(collection)
    folder, path, listed = lexical.index_dir(cfg), pages.path_of(cfg), inventory.path_of(cfg)
    saved_pages = pages.load(path)  # the previous pages: a document keeps its page
    terms = lexical.LexicalRows() if lexical.saved_stamp(folder) != stamp else None
    stale_pages = saved_pages is None or saved_pages.stamp != (*stamp, paging.tokens)
    parents = pages.ParentSums() if stale_pages and paging.tokens else None  # pages off (0 tokens): no vectors
    documents = inventory.DocumentRows() if inventory.recorded_stamp(listed) != stamp else None
    built: list[tuple[RowsBuilder | None, list[str]]] = [
        (terms, lexical.ROWS_READ), (parents, pages.ROWS_READ), (documents, inventory.ROWS_READ)]
    builders = [(builder, reads) for builder, reads in built if builder is not None]
    if builders:
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
