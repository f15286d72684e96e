"""The ingest summary (text and JSON) and a progress bar that only shows on a terminal."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class IngestReport:
    dry_run: bool = False
    files_seen: int = 0
    files_added: int = 0
    files_updated: int = 0
    files_unchanged: int = 0
    files_removed: int = 0
    documents_removed: int = 0
    skipped_unknown: int = 0
    skipped_unreadable: list[dict[str, Any]] = field(default_factory=list)  # no regular file: dangling links, FIFOs ...
    failed: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    chunks_written: int = 0
    chunks_embedded: int = 0
    chunks_deleted: int = 0
    chunks_relabeled: int = 0  # metadata-only updates (file hash, path, size) of chunks whose text did not change
    seconds: float = 0.0
    # Where the run's own thread spent its time, seconds: "scan" (what is stored), "load" (waiting for files to be
    # loaded and chunked), "embed", "store" (waiting for Chroma's writes), "indexes" (BM25 and pages rebuilt).
    stages_s: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.stages_s[stage] = round(self.stages_s.get(stage, 0.0) + time.perf_counter() - started, 3)

    @property
    def writes(self) -> int:
        return self.chunks_written + self.chunks_deleted + self.chunks_relabeled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"files_failed": len(self.failed)}

    def summary(self) -> str:
        verb = "would write" if self.dry_run else "wrote"
        lines = [
            f"files: {self.files_seen} seen, {self.files_added} added, {self.files_updated} updated, "
            f"{self.files_unchanged} unchanged, {self.files_removed} removed, {len(self.failed)} failed, "
            f"{self.skipped_unknown} skipped (unknown type), {len(self.skipped_unreadable)} skipped (not a file)",
            f"chunks: {verb} {self.chunks_written} ({self.chunks_embedded} embedded), "
            f"deleted {self.chunks_deleted}; {self.seconds:.1f}s",
        ]
        lines += [f"failed: {f['path']}: {f['reason']}" for f in self.failed]
        lines += [f"skipped: {f['path']}: {f['reason']}" for f in self.skipped_unreadable]
        lines += [f"warning: {w}" for w in self.warnings[:20]]
        if len(self.warnings) > 20:
            lines.append(f"... and {len(self.warnings) - 20} more warnings (see --json)")
        return "\n".join(lines)


class Progress:
    """On a terminal, a rich progress bar over files. Elsewhere (nohup, docker logs, CI) one line on stderr every
    ``interval_s``, and a last one when the run's writes are done: files, chunks, chunks/s, ETA. ``enabled=False``
    (library use): silent. Either way it counts the files done, for the line an interrupted run prints."""

    def __init__(self, enabled: bool | None = None, interval_s: float = 10.0) -> None:
        self.enabled = True if enabled is None else enabled
        self.terminal = enabled is None and sys.stderr.isatty()
        self.interval_s = interval_s
        self.files_done = 0

    @contextmanager
    def files(self, total: int, written: Callable[[], int]) -> Iterator[Callable[[str], None]]:
        """Yields ``advance(name)``, called once per file done; ``written()`` is the chunks stored so far (writes
        are batched, so it lags the files: the last line is printed on leaving, after the caller's last write)."""
        if not self.enabled:
            yield self._count
        elif self.terminal:
            with self._bar(total) as update:
                def advance(name: str) -> None:
                    self._count(name)
                    update(name, written())

                yield advance
        else:
            started = time.monotonic()
            yield self._lines(total, written, started)
            self._line(total, written(), time.monotonic() - started)

    def _count(self, name: str) -> None:
        self.files_done += 1

    def _lines(self, total: int, written: Callable[[], int], started: float) -> Callable[[str], None]:
        last = started

        def line(name: str) -> None:
            nonlocal last
            self._count(name)
            now = time.monotonic()
            if now - last >= self.interval_s and self.files_done < total:
                last = now
                self._line(total, written(), now - started)

        return line

    def _line(self, total: int, chunks: int, elapsed: float) -> None:
        eta = elapsed / self.files_done * (total - self.files_done) if self.files_done else 0.0
        print(f"ingest: {self.files_done}/{total} files, {chunks} chunks written, "
              f"{chunks / elapsed if elapsed else 0:.1f} chunks/s, ETA {eta:.0f}s", file=sys.stderr, flush=True)

    @contextmanager
    def _bar(self, total: int) -> Iterator[Callable[[str, int], None]]:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        with Bar(TextColumn("[bold]ingest"), BarColumn(), MofNCompleteColumn(),
                 TextColumn("{task.fields[chunks]} chunks"),
                 TimeElapsedColumn(), TextColumn("{task.fields[name]}"), transient=True) as bar:
            task = bar.add_task("files", total=total, chunks=0, name="")
            yield lambda name, chunks: bar.update(task, advance=1, chunks=chunks, name=name[-50:])
