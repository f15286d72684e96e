"""docker/: the compose file is valid for both profiles (Debian's docker-compose), and its vLLM and router flags
are the ones the project's launchers use, so the containers behave like `python -m app.cluster`."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from app.core.settings import VLLMServerSettings
from app.vllm.cluster import ROUTER_FLAGS
from app.vllm.entry import PRIME_ENV
from app.vllm.launcher import build_command
from tests.support.env import ROOT

COMPOSE = ROOT / "docker" / "compose.yaml"


def flags(argv: list[str]) -> dict[str, str | None]:
    """``--name=value`` / ``--name value`` / ``--switch`` -> {name: value or None}."""
    found, index = {}, 0
    while index < len(argv):
        name, _, value = argv[index].partition("=")
        if not value and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            value, index = argv[index + 1], index + 1
        found[name] = value or None
        index += 1
    return found


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.mark.parametrize("profile", ["gpu", "cpu"])
def test_the_compose_file_validates(profile):
    binary = shutil.which("docker-compose")
    assert binary, "Debian's docker-compose is needed (scripts/test.sh installs it)"
    result = subprocess.run([binary, "-f", str(COMPOSE), "--env-file", str(ROOT / "docker" / ".env.example"),
                             "--profile", profile, "config", "-q"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_gpu_replicas_use_exactly_the_launchers_flags(compose):
    argv, _ = build_command(VLLMServerSettings(model="some/model"), gpu=True)
    launcher = flags(argv[argv.index("app.vllm.entry") + 1:])
    replica = compose["x-vllm-gpu"]
    entry = replica["entrypoint"][-1]  # the launcher's entry module, mounted into vLLM's image
    assert f"../app/vllm_entry.py:{entry}:ro" in replica["volumes"] and PRIME_ENV in replica["environment"]
    assert set(flags(replica["command"])) == set(launcher)
    fixed = {"--enable-prefix-caching", "--enable-chunked-prefill", "--enable-prompt-tokens-details",
             "--enable-tokenizer-info-endpoint", "--scheduling-policy", "--dtype", "--tensor-parallel-size"}
    assert {k: flags(replica["command"])[k] for k in fixed} == {k: launcher[k] for k in fixed}


def test_both_routers_use_the_cluster_launchers_policy_flags(compose):
    for name in ("router", "router-cpu"):
        command = flags(compose["services"][name]["command"])
        assert {k: command[k] for k in flags(ROUTER_FLAGS)} == flags(ROUTER_FLAGS), name
