"""``python -m bench.index [--check]``: write ``bench/results/INDEX.md``, one row per result file: what it
measured, the exact command that made it, the commit that added it, and where the docs cite it. ``--check``
fails when the index is out of date (a result added, removed or re-run without re-indexing)."""

from __future__ import annotations

import argparse
import fnmatch
import re
import subprocess
import sys
from pathlib import Path

from bench.report import report

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
INDEX = RESULTS / "INDEX.md"
DOCS = ("README.md", "bench/README.md", "docs/benchmarks.md", "docs/design.md", "docs/api.md",
        "docs/operations.md", "docker/README.md")
DATASETS = ("squad-v2.0-half", "squad-v1.1", "scifact", "tatqa")  # file names are often written DATASET-...
HEAD = """# Benchmark results: claim -> file -> command -> commit

Every file in `bench/results/` (GPU runs under `gpu/`), with what it measured, the command that made it (as the
file records it; `python -m bench.report FILE` prints its whole table), the commit that added it and the pages that
cite it. Superseded runs are not kept here: git history has them. Written by `python -m bench.index`.

| file | what | command | commit | cited in |
| --- | --- | --- | --- | --- |
"""


def first_commit(path: Path) -> str:
    found = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--", str(path.relative_to(ROOT))],
                           cwd=ROOT, capture_output=True, text=True).stdout.split()
    return f"`{found[-1]}`" if found else "(uncommitted)"


def cited_in(path: Path, pages: dict[str, str]) -> str:
    """The pages naming this file: by its name, as ``DATASET-...``, or through a glob (``gpu/*-h200-*.json``)."""
    stem, relative = path.stem, str(path.relative_to(RESULTS))
    forms = {stem} | {stem.replace(name, "DATASET", 1) for name in DATASETS if stem.startswith(name)}

    def cites(text: str) -> bool:
        if any(form in text for form in forms):
            return True
        globs = (g.split("results/", 1)[-1] for g in re.findall(r"results/[\w./*{},-]*\*[\w./*-]*", text))
        return any(fnmatch.fnmatch(relative, glob) or fnmatch.fnmatch(relative, glob + "*") for glob in globs)

    return ", ".join(page for page, text in pages.items() if cites(text)) or "–"


def row(path: Path, pages: dict[str, str]) -> str:
    title, _, command = report(path).split("\n", 1)[0].partition(" — ")
    what = title.strip("*").replace("|", "/")
    if what == path.name:
        what = "figures"
    return (f"| [`{path.relative_to(RESULTS)}`]({path.relative_to(RESULTS)}) | {what} | {command.replace('|', '/')} "
            f"| {first_commit(path)} | {cited_in(path, pages)} |")


def index() -> str:
    pages = {page: (ROOT / page).read_text() for page in DOCS if (ROOT / page).exists()}
    return HEAD + "\n".join(row(path, pages) for path in sorted(RESULTS.rglob("*.json"))) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if bench/results/INDEX.md is out of date")
    args = parser.parse_args(argv)
    if not args.check:
        INDEX.write_text(index())
        return 0
    if INDEX.read_text() != index():
        print("error: bench/results/INDEX.md is out of date: run python -m bench.index", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
