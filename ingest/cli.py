"""``python -m ingest PATH...``: a thin shell over ``ingest.pipeline.run_ingest``.

Exit codes: 0 every file ingested (or unchanged); 1 some files failed and were skipped (the rest ingested);
2 usage error; 3 could not run (Chroma unreachable, lock held, bad settings); 130 interrupted (Ctrl-C or
SIGTERM: finished files are stored, a re-run resumes).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from app.core.records import DOCUMENT_SUFFIXES
from app.core.version import add_version

if TYPE_CHECKING:
    from app.core.settings import Settings

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_FATAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ingest", description="Load, chunk, embed and upsert documents into Chroma (idempotent).",
        epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                        help=f"files or folders ({' '.join(DOCUMENT_SUFFIXES)})")
    parser.add_argument("--collection", help="Chroma collection name (default: PREFIXRAG_COLLECTION or 'docs')")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--chroma-path", type=Path, help="on-disk Chroma directory (default ./data/chroma)")
    where.add_argument("--chroma-url", help="Chroma server URL, e.g. http://127.0.0.1:8001")
    parser.add_argument("--parent-field", help="jsonl field that groups records into one parent document")
    parser.add_argument("--prune", action="store_true",
                        help="also delete documents not found under PATHs (the collection mirrors them)")
    parser.add_argument("--dry-run", action="store_true", help="report what would change; write nothing")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    return add_version(parser)


def settings_from(args: argparse.Namespace) -> Settings:
    from app.core.settings import Settings, overridden

    settings = Settings()
    if args.chroma_path and not args.chroma_url:  # a folder asked for: not the server the environment names
        settings = overridden(settings, {"chroma.url": ""})
    return overridden(settings, {"chroma.collection": args.collection, "chroma.path": args.chroma_path,
                                 "chroma.url": args.chroma_url, "chunking.parent_field": args.parent_field})


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (docker stop, systemd) ends the run like Ctrl-C: one line, exit 130


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ingest.report import Progress

    progress = Progress()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        from pydantic import ValidationError

        from app.core.embedder import Embedder
        from app.core.settings import invalid_setting
        from app.core.store import StoreError
        from ingest.pipeline import run_ingest

        settings = settings_from(args)
        progress.interval_s = settings.ingest.progress_s
        for path in args.paths:  # fail before the encoder takes seconds to load
            if not path.exists():
                raise FileNotFoundError(f"no such file or directory: {path}")
        embedder = Embedder(settings.embedding)
        report = run_ingest(args.paths, settings, embedder, prune=args.prune, dry_run=args.dry_run,
                            progress=progress)
    except KeyboardInterrupt:
        print(f"interrupted after {progress.files_done} files; re-run to resume (finished files are stored)",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    except (StoreError, FileNotFoundError, ValidationError, ValueError) as exc:
        message = invalid_setting(exc) if isinstance(exc, ValidationError) else str(exc).splitlines()[0]
        print(f"error: {message}", file=sys.stderr)
        return EXIT_FATAL
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(report.summary())
    return EXIT_SOME_FAILED if report.failed else EXIT_OK

