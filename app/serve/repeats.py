"""Repeated failures of one kind, aggregated in the log: while vLLM is down every request fails the same way, and
one line per request (its 503 and its access line) would bury everything else. The first of a kind is logged as
it is; then one line per interval counts those held back; one line says when they stopped."""

from __future__ import annotations

import atexit
import collections
import logging
import math
import threading
import time
from dataclasses import dataclass

SUMMARY = "prefixrag_repeats"  # set on the summary records themselves, which are never held back


@dataclass
class Episode:
    record: logging.LogRecord  # the first of its kind: the summaries quote its message
    started: float
    last: float
    held: int = 0  # held back since the last summary
    total: int = 1


class Repeats(logging.Filter):
    def __init__(self, interval_s: float) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._episodes: dict[tuple[object, ...], Episode] = {}
        self._lock = threading.Lock()
        self._late: collections.deque[tuple[tuple[object, ...], logging.LogRecord, float]] = collections.deque()
        self._reported = time.monotonic()

    def start(self) -> Repeats:
        """Summaries are written by a thread of their own: an outage's end is logged even when nothing else is;
        at exit, what was still held back is counted."""
        threading.Thread(target=self._run, name="log-repeats", daemon=True).start()
        atexit.register(self.close)
        return self

    def close(self) -> None:
        """Count what is still held back, now (a server stopped by a signal may never reach ``atexit``)."""
        self.flush(math.inf)

    def filter(self, record: logging.LogRecord) -> bool:
        """Log it (the first of its kind), or hold it back and count it. Never waits for the summary thread: the
        caller is mostly the serving loop (a 429's access line, hundreds a second under a retry storm), and that
        thread, holding the lock, may wait for a core or the GIL for tens of milliseconds; a record arriving then
        is counted when the summary thread next takes the lock."""
        kind = failure_kind(record)
        if kind is None or getattr(record, SUMMARY, False):
            return True
        now = time.monotonic()
        if not self._lock.acquire(blocking=False):
            self._late.append((kind, record, now))  # deque.append: safe without the lock
            return kind not in self._episodes  # the first of its kind is logged (rarely, two firsts are)
        try:
            return self._count(kind, record, now)
        finally:
            self._lock.release()

    def _count(self, kind: tuple[object, ...], record: logging.LogRecord, now: float) -> bool:
        """Under the lock: True for the first of an episode, else it is counted as held back."""
        episode = self._episodes.get(kind)
        if episode is None:
            self._episodes[kind] = Episode(record, now, now)
            return True
        episode.last, episode.held, episode.total = now, episode.held + 1, episode.total + 1
        return False

    def flush(self, now: float | None = None) -> None:
        """One line per kind held back since the last summary; one line per kind that has stopped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            while self._late:  # counted late: they came while the lock was held
                self._count(*self._late.popleft())
            due = now - self._reported >= self.interval_s
            if due:
                self._reported = now
            lines = []
            for kind, episode in list(self._episodes.items()):
                if now - episode.last >= self.interval_s:
                    del self._episodes[kind]
                    if episode.total > 1:
                        lines.append((episode, f"stopped: {episode.total} in {episode.last - episode.started:.0f}s"))
                elif due and episode.held:
                    lines.append((episode, f"{episode.held} more in the last {self.interval_s:.0f}s"))
                    episode.held = 0
        for episode, note in lines:
            first = episode.record
            logging.getLogger(first.name).log(first.levelno, "repeated (%s): %s", note, first.getMessage(),
                                              extra={SUMMARY: True})

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.interval_s))
            self.flush()


def failure_kind(record: logging.LogRecord) -> tuple[object, ...] | None:
    """What makes two failures the same: an access line's method, path and status (429 and 5xx), or our own
    failure line's status and code (``app.serve.http_errors``); None for anything else."""
    args = record.args if isinstance(record.args, tuple) else ()
    if record.name == "uvicorn.access" and len(args) == 5:  # (client, method, path, http version, status)
        status = int(str(args[4]))
        return ("access", args[1], str(args[2]).split("?")[0], status) if status == 429 or status >= 500 else None
    if record.name == "prefixrag.http" and record.levelno == logging.WARNING and len(args) == 3:
        return ("failure", args[0], args[1])
    return None
