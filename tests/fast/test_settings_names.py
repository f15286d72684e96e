"""Settings from the environment under our own prefix: a misspelt name stops every entry point with the closest
valid one; the old ``RAG_`` prefix is still read for this release, with a warning, and an old name that is no
setting of ours (Open WebUI's ``RAG_EMBEDDING_MODEL``) is left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app.core import settings_names
from app.core.settings import Settings, UnknownSetting
from tests.support.env import ROOT


def run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PREFIXRAG_", "RAG_"))}
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=clean | env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv", [["-m", "app"], ["-m", "ingest", "docs"], ["-m", "app.vllm_server", "--dry-run"]])
def test_a_misspelt_setting_stops_each_entry_point_with_the_closest_name(argv):
    done = run(argv, PREFIXRAG_SERVICE__PROT="9000")
    assert done.returncode == (3 if argv[1] == "ingest" else 2), done.stderr  # ingest: its fatal-error status
    assert done.stderr.strip().splitlines()[-1] == (
        "error: unknown setting PREFIXRAG_SERVICE__PROT (environment); did you mean PREFIXRAG_SERVICE__PORT?")


def test_the_old_prefix_is_read_with_a_warning_and_the_new_one_wins(monkeypatch, caplog, tmp_path):
    monkeypatch.chdir(tmp_path)  # no .env here
    monkeypatch.setenv("RAG_SERVICE__PORT", "9001")
    monkeypatch.setenv("RAG_TOP_K", "7")
    monkeypatch.setenv("RAG_EMBEDDING_MODEL", "open-webui's, not ours")
    monkeypatch.setenv("PREFIXRAG_TAG", "latest")  # compose's, not a setting: allowed
    monkeypatch.setattr(settings_names, "_warned", set())  # warned once per process: this test's own
    with caplog.at_level("WARNING", logger="prefixrag.settings"):
        settings = Settings()
    assert (settings.service.port, settings.limits.top_k) == (9001, 7)
    warned = [r.getMessage() for r in caplog.records]
    assert any("RAG_SERVICE__PORT is read as PREFIXRAG_SERVICE__PORT" in w for w in warned), warned
    assert not any("EMBEDDING_MODEL" in w for w in warned)
    monkeypatch.setenv("PREFIXRAG_SERVICE__PORT", "9002")
    assert Settings().service.port == 9002


def test_a_misspelt_name_in_dotenv_is_refused_too(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("PREFIXRAG_COLLECTON=docs2\n")
    with pytest.raises(UnknownSetting, match=r"PREFIXRAG_COLLECTON \(\.env\); did you mean PREFIXRAG_COLLECTION\?"):
        Settings()
    (tmp_path / ".env").write_text("RAG_COLLECTION=docs2\n")
    assert Settings().chroma.collection == "docs2"
