"""What a writer leaves beside the collection after changing it: the BM25 index and the pages, each stamped with
the collection's generation and row count (``app.core.lexical``, ``app.core.pages``).

Both are built from every row of the collection. Where both are stale (every run that wrote), they are built from
one read of the rows, a page at a time, tokenized and summed as the pages arrive: a large collection is read once,
not once per index, and its texts are never all held at once.
"""

from __future__ import annotations

from app.core import lexical, pages
from app.core.seams import Collection
from app.core.settings import ChromaSettings, PageSettings
from app.core.store import all_rows, stamp_of


def save_current(collection: Collection, cfg: ChromaSettings, paging: PageSettings) -> None:
    """Save the BM25 index and the pages for the collection as it is now, rebuilding only what is stale (the
    caller holds the write lock: ingest at the end of a run, the documents API after a delete)."""
    stamp = stamp_of(collection)
    folder, path = lexical.index_dir(cfg), pages.path_of(cfg)
    saved_lexical, saved_pages = lexical.load(folder), pages.load(path)
    lexical_stale = saved_lexical is None or saved_lexical.stamp != stamp
    pages_stale = saved_pages is None or saved_pages.stamp != (*stamp, paging.tokens)
    if not (lexical_stale or pages_stale):
        return
    terms, parents = lexical.LexicalRows(), pages.ParentSums()
    summed = pages_stale and paging.tokens > 0  # pages off (0 tokens) need no vectors
    include = sorted(set(lexical.ROWS_READ) | (set(pages.ROWS_READ) if summed else set()))
    for rows in all_rows(collection, include):
        if lexical_stale:
            terms.add(rows)
        if summed:
            parents.add(rows)
    if lexical_stale:
        lexical.save(terms.index(stamp[0]), folder)
    if pages_stale:
        pages.save(pages.build_from(parents.parents(), stamp, paging.tokens, saved_pages), path)
