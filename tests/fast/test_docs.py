"""The docs stay true to the code: the configuration page is the settings' own, the results index lists every
result file, the README stays short, and every result file a page cites exists."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys

from tests.support.env import ROOT

PAGES = ["README.md", "bench/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def test_the_configuration_page_and_the_results_index_are_current():
    for argv in (["scripts/settings_doc.py", "--check"], ["-m", "bench.index", "--check"]):
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr


def test_the_readme_is_read_in_five_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


def test_every_result_file_a_page_cites_exists():
    results = [str(p.relative_to(ROOT / "bench" / "results")) for p in (ROOT / "bench" / "results").rglob("*")]
    for page in PAGES:
        for cited in re.findall(r"results/([\w./*-]+\.(?:json|png))", (ROOT / page).read_text()):
            if re.search(r"[A-Z]{3,}", cited):  # a template of names (DATASET-c4.json), not a file
                continue
            assert any(fnmatch.fnmatch(name, cited) for name in results), f"{page} cites {cited}"


def test_every_relative_link_of_the_docs_resolves():
    for page in PAGES:
        folder = (ROOT / page).parent
        for target in re.findall(r"\]\((?!https?://|#)([^)#\s]+)", (ROOT / page).read_text()):
            assert (folder / target).exists(), f"{page} links to {target}"
