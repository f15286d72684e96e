"""docker/: the compose file is valid for both profiles (Debian's docker-compose), and its vLLM and router flags
are the ones the project's launchers use, so the containers behave like `python -m app.cluster`."""

from __future__ import annotations

import os
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
ENV_EXAMPLE = ROOT / "docker" / ".env.example"


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


@pytest.mark.parametrize("files", [["compose.yaml"], ["compose.yaml", "compose.two-replicas.yaml"]])
@pytest.mark.parametrize("profile", ["gpu", "cpu", "tools"])
def test_the_compose_file_validates(profile, files):
    binary = shutil.which("docker-compose")
    assert binary, "Debian's docker-compose is needed (scripts/test.sh installs it)"
    chosen = [arg for name in files for arg in ("-f", str(ROOT / "docker" / name))]
    result = subprocess.run([binary, *chosen, "--env-file", str(ENV_EXAMPLE), "--profile", profile, "config", "-q"],
                            capture_output=True, text=True, timeout=120,
                            env=os.environ | {"APP_ENV_FILE": ENV_EXAMPLE.name})
    assert result.returncode == 0, result.stderr


def test_every_prefixrag_line_of_the_env_example_is_a_setting_the_app_and_ingest_accept():
    """docker/.env reaches the app and ingest whole (env_file): a compose-only variable under our prefix would
    stop both at start-up as an unknown setting."""
    from app.core.settings import Settings
    from app.core.settings_names import adopted, known_names

    lines = [line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines() if "=" in line]
    variables = {name.lstrip("# ").strip(): value for name, value in lines}
    assert any(name.startswith("PREFIXRAG_") for name in variables)
    adopted(variables, known_names(Settings), "docker/.env.example")  # raises UnknownSetting


def test_gpu_replicas_use_exactly_the_launchers_flags(compose):
    argv, _ = build_command(VLLMServerSettings(model="some/model"), gpu=True)
    module = argv.index("app.vllm.entry")
    launcher = flags(argv[module + 1:])
    replica = compose["x-vllm-gpu"]
    assert replica["entrypoint"] == ["python3", "-m", argv[module]]  # the launcher's entry module, mounted
    mounts = [volume.split(":") for volume in replica["volumes"] if volume.startswith("../")]
    assert ["../app", f"{replica['environment']['PYTHONPATH']}/app", "ro"] in mounts
    assert all((COMPOSE.parent / source).exists() for source, *_ in mounts)
    assert PRIME_ENV in replica["environment"]
    assert set(flags(replica["command"])) == set(launcher)
    fixed = {"--enable-prefix-caching", "--enable-chunked-prefill", "--enable-prompt-tokens-details",
             "--enable-tokenizer-info-endpoint", "--scheduling-policy", "--dtype", "--tensor-parallel-size"}
    assert {k: flags(replica["command"])[k] for k in fixed} == {k: launcher[k] for k in fixed}


def test_both_routers_use_the_cluster_launchers_policy_flags(compose):
    overlay = yaml.safe_load((ROOT / "docker" / "compose.two-replicas.yaml").read_text())
    for services, name in [(c["services"], n) for c in (compose, overlay) for n in ("router", "router-cpu")]:
        command = flags(services[name]["command"])
        assert {k: command[k] for k in flags(ROUTER_FLAGS)} == flags(ROUTER_FLAGS), name


def test_the_app_gets_longer_to_stop_than_its_drain_and_is_published_on_this_host_only(compose):
    from app.core.settings import TrafficSettings

    app = compose["services"]["app"]
    assert int(app["stop_grace_period"].removesuffix("s")) > TrafficSettings().drain_s + 5
    assert all(port.startswith("${APP_BIND:-127.0.0.1}:") for port in app["ports"])
