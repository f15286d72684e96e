"""SIGKILL an ingest while it writes; the next run must converge to exactly what a clean ingest produces."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from ingest.pipeline import run_ingest
from tests.support.corpora import collection_of, lexical_ids, snapshot
from tests.support.env import ROOT

WORDS = ("harbour tide anchor keel mast rope gull wave reef compass chart beacon current drift sail "
         "storm pier buoy lantern cargo hull deck helm knot port starboard").split()


def write_big_corpus(root, files=40, paragraphs=12, seed=7):
    rng = random.Random(seed)
    root.mkdir(parents=True)
    for number in range(files):
        body = "\n\n".join(" ".join(rng.choice(WORDS) for _ in range(60)) + "." for _ in range(paragraphs))
        (root / f"log-{number:03d}.md").write_text(f"# Log {number}\n\n{body}\n")
    return root


def stored_rows(db_path) -> int:
    try:
        with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=1) as db:
            return db.execute("select count(*) from embeddings").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.parametrize("files,paragraphs", [(40, 12), (1, 480)], ids=["many-files", "one-big-document"])
def test_sigkill_mid_ingest_then_rerun_equals_clean_ingest(tmp_path, settings_factory, embedder, files, paragraphs):
    corpus = write_big_corpus(tmp_path / "corpus", files, paragraphs)
    crashed, clean = settings_factory(path=tmp_path / "crashed"), settings_factory(path=tmp_path / "clean")
    process = subprocess.Popen(
        [sys.executable, "-m", "ingest", str(corpus), "--chroma-path", str(crashed.chroma.path),
         "--collection", crashed.chroma.collection], cwd=ROOT,
        env=os.environ | {"PREFIXRAG_INGEST__WRITE_BATCH": "16"}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while stored_rows(crashed.chroma.path / "chroma.sqlite3") < 48:
        assert process.poll() is None, f"ingest ended before it could be killed: {process.stderr.read()}"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    partial = len(snapshot(crashed, embedder))
    # Before any re-run, a service's lexical view (saved copy or rebuilt) is exactly what Chroma holds.
    from app.core import lexical

    assert set(lexical.current(collection_of(crashed, embedder), crashed.chroma).ids) == set(
        snapshot(crashed, embedder))
    report = run_ingest([corpus], crashed, embedder)
    run_ingest([corpus], clean, embedder)
    expected = snapshot(clean, embedder)
    assert 0 < partial < len(expected), "the kill must land mid-ingest for this test to mean anything"
    assert snapshot(crashed, embedder) == expected
    assert lexical_ids(crashed) == set(expected)
    assert report.chunks_embedded <= len(expected) - partial + 16  # stored work was re-used, not redone
    assert run_ingest([corpus], crashed, embedder).writes == 0


def test_without_a_terminal_ingest_prints_progress_lines_and_ctrl_c_is_one_line(tmp_path, settings_factory, embedder):
    corpus = write_big_corpus(tmp_path / "corpus")
    interrupted, clean = settings_factory(path=tmp_path / "interrupted"), settings_factory(path=tmp_path / "clean")
    process = subprocess.Popen(
        [sys.executable, "-m", "ingest", str(corpus), "--chroma-path", str(interrupted.chroma.path),
         "--collection", interrupted.chroma.collection], cwd=ROOT, text=True,
        env=os.environ | {"PREFIXRAG_INGEST__WRITE_BATCH": "16", "PREFIXRAG_INGEST__PROGRESS_S": "0.01"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        # A suite started in the background by a shell (`cmd &`) inherits SIGINT ignored, and so would ingest:
        # give it the default a terminal's Ctrl-C meets.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    progress = []
    while len(progress) < 3:  # stderr is a pipe, not a terminal: lines, not a progress bar
        line = process.stderr.readline()
        assert line, "ingest ended before it printed progress"
        if line.startswith("ingest: "):
            progress.append(line)
    os.killpg(process.pid, signal.SIGINT)  # as a terminal sends it: to the whole process group
    rest = process.stderr.read()
    assert process.wait(60) == 130
    assert "files" in progress[0] and "chunks/s" in progress[0] and "ETA" in progress[0]
    assert "Traceback" not in rest and rest.strip().splitlines()[-1].startswith("interrupted after "), rest
    run_ingest([corpus], interrupted, embedder)
    run_ingest([corpus], clean, embedder)
    assert snapshot(interrupted, embedder) == snapshot(clean, embedder)
