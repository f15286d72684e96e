"""The package as users install it: the wheel carries the prompts and the page, the console script dispatches
to every entry point, and each entry point answers --help and --version without starting anything."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.support.env import ROOT


def test_the_wheel_ships_prompts_page_and_console_script(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = zipfile.ZipFile(next(tmp_path.glob("prefixrag-*.whl")))
    names = set(wheel.namelist())
    static = {f"app/serve/static/{name}" for name in ("index.html", "app.js", "style.css", "vendor/marked.umd.js",
                                                      "vendor/purify.min.js", "vendor/LICENSE-marked")}
    assert {"prompts/rag.toml", *static} <= names
    entry_points = wheel.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "prefixrag = app.cli:main" in entry_points
    assert any(n.endswith("licenses/LICENSE") or n.endswith("/LICENSE") for n in names)


@pytest.mark.parametrize("argv", [["-m", "app"], ["-m", "ingest"], ["-m", "app.vllm_server"], ["-m", "app.cluster"],
                                  ["-m", "app.cli", "serve"], ["-m", "app.cli", "ingest"]])
def test_every_entry_point_answers_help_and_exits(argv):
    result = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: ") and "--version" in result.stdout


@pytest.mark.parametrize("argv", [["-m", "app"], ["-m", "ingest"], ["-m", "app.vllm_server"], ["-m", "app.cluster"],
                                  ["-m", "app.cli"], ["-m", "app.cli", "serve"]])
def test_every_entry_point_says_its_version(argv):
    from importlib import metadata

    result = subprocess.run([sys.executable, *argv, "--version"], capture_output=True, text=True, timeout=120,
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(" " + metadata.version("prefixrag")), result.stdout


def test_the_console_script_refuses_an_unknown_command():
    result = subprocess.run([sys.executable, "-m", "app.cli", "frobnicate"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr
