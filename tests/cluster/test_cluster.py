"""Scale-out with real parts: two vLLM CPU replicas behind the real vllm-router (consistent_hash, keyed by each
prompt's stable prefix), the app in front. Which replica served a request is read from the replicas' own
/metrics, never from the app."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from openai import OpenAI

from app.serve.app import create_app
from app.vllm.cluster import Cluster
from app.vllm.process import free_port
from app.vllm.prometheus import metric_total
from tests.support.corpora import app_settings, tiny_squad
from tests.support.servers import AppServer

pytestmark = [pytest.mark.vllm, pytest.mark.cluster]

# The `long` collection: 24 documents of ~330 tokens, each its own unit under the document strategy.
ONE_UNIT = {"source_prefix": "log-03.md"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    first = free_port()
    with Cluster(2, ["--test-model", "--dev-mode", "--max-model-len", "4096"], tmp_path_factory.mktemp("cluster"),
                 first_vllm_port=first, router_port=None, router_metrics_port=None, chroma_port=None,
                 chroma_path=tmp_path_factory.mktemp("unused"),
                 replica_env={"VLLM_CPU_KVCACHE_SPACE": "1"}, startup_timeout_s=600) as running:
        yield running


@pytest.fixture(scope="module")
def server(cluster, collections, embedder):
    settings = app_settings(collections, cluster.router_url, collection="long", strategy="document",
                            hotness_dir=None)
    with AppServer(create_app(settings, embedder=embedder)) as running:
        running.wait_ready(120)
        running.wait_warmed(units=24, timeout=300, done=True)
        yield running


def served(cluster: Cluster) -> list[float]:
    """Requests each replica has finished (its vllm:request_success_total)."""
    return [metric_total(httpx.get(f"{url}/metrics", timeout=10).text, "vllm:request_success_total")
            for url in cluster.replica_urls]


def replica_of(cluster: Cluster, before: list[float]) -> int:
    after = served(cluster)
    changed = [i for i, (a, b) in enumerate(zip(after, before)) if a != b]
    assert len(changed) == 1, f"one replica should have served it: before {before}, after {after}"
    return changed[0]


def ask(server: AppServer, question: str) -> dict:
    response = httpx.post(f"{server.url}/ask", json={"question": question, "filters": ONE_UNIT}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_pre_warm_spreads_units_over_both_replicas_and_readyz_counts_them(cluster, server):
    status = httpx.get(f"{server.url}/readyz", timeout=10).json()
    assert status["router"]["healthy"] == status["router"]["total"] == 2
    assert all(count > 0 for count in served(cluster)), "each replica should hold some of the 24 units"


def test_two_questions_about_one_unit_reach_the_same_replica_and_hit_its_cache(cluster, server):
    before = served(cluster)
    first = ask(server, "Why do tides rise twice a day?")
    replica = replica_of(cluster, before)
    before = served(cluster)
    second = ask(server, "Which way does a compass needle point?")
    assert replica_of(cluster, before) == replica
    assert first["usage"]["cached_tokens"] >= 256 and second["usage"]["cached_tokens"] >= 256


def test_a_three_turn_conversation_stays_on_one_replica(cluster, server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages, replicas = [], []
    for question in ("What holds a ship in place?", "And what pushes it downwind?", "What about the moon?"):
        messages.append({"role": "user", "content": question})
        before = served(cluster)
        reply = client.chat.completions.create(model="prefixrag", messages=messages, max_tokens=8)
        replicas.append(replica_of(cluster, before))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or "..."})
    assert len(set(replicas)) == 1, replicas


def test_benchmarks_through_the_router_sum_the_replicas_and_replay_each_prompt_to_its_replica(cluster, tmp_path):
    from bench.prefix_cache import main as prefix_cache
    from bench.replay import main as replay

    out, prompts = tmp_path / "routed.json", tmp_path / "prompts"
    assert prefix_cache(["--data", str(tiny_squad(tmp_path / "tiny")), "--questions", "10", "--top-k", "2",
                         "--vllm-url", cluster.router_url, "--max-tokens", "4", "--modes", "prefixrag",
                         "--out", str(out), "--dump-prompts", str(prompts)]) == 0
    routed = json.loads(out.read_text())["results"][0]
    assert routed["errors"] == 0 and routed["queries"] > 0
    assert set(routed["replicas"]) == set(cluster.replica_urls)
    assert sum(r["requests"] for r in routed["replicas"].values()) == 10
    assert replay(["--prompts", str(prompts), "--vllm-url", cluster.router_url, "--out", str(tmp_path / "r.json")]) == 0
    replayed = json.loads((tmp_path / "r.json").read_text())["results"][0]
    assert replayed["errors"] == 0 and sum(r["requests"] for r in replayed["replicas"].values()) == 10
    # Each prompt went to the replica its key names, after its own pre-warm there: the same cache, the same hits.
    requests = [[r["requests"] for r in run["replicas"].values()] for run in (replayed, routed)]
    assert requests[0] == requests[1]
    assert replayed["hit_rate"] == pytest.approx(routed["hit_rate"], abs=0.02)


def test_a_killed_replica_leaves_ask_answering_and_when_back_it_is_re_warmed(cluster, server):
    before = served(cluster)
    ask(server, "Why do tides rise twice a day?")
    home = replica_of(cluster, before)
    other = 1 - home
    cluster.kill_replica(home)
    for _ in range(3):  # the router retries on the other replica at once
        assert ask(server, "Why do tides rise twice a day?")["answer"] is not None
    wait_for(lambda: readyz(server)["router"]["healthy"] == 1, 60, "the app to see one healthy replica")
    assert readyz(server)["ready"] is True

    cluster.kill_replica(other)  # none left: a fast 503 with Retry-After, and not ready
    wait_for(lambda: refused_for_now(server), 60, "/ask to answer 503 + Retry-After")
    wait_for(lambda: readyz(server)["reason"] == "vllm-router has no healthy replica (0/2)", 60,
             "/readyz to say why it is not ready")
    assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 503

    cluster.restart_replica(other, wait=False)
    cluster.restart_replica(home)
    cluster.wait_replica(other)
    wait_for(lambda: readyz(server).get("router", {}).get("healthy") == 2, 120, "the app to see both back")
    # Only pre-warm talks to the fresh replica until we ask: it has served some once that warm-up is done.
    wait_for(lambda: served(cluster)[home] > 0 and readyz(server)["warmup"]["state"] == "done", 300,
             "pre-warm to put the returned replica's units back")
    again = ask(server, "Why do tides rise twice a day?")
    assert again["usage"]["cached_tokens"] >= 256, "the unit was re-warmed on its replica before anyone asked"


def refused_for_now(server: AppServer) -> bool:
    response = httpx.post(f"{server.url}/ask", json={"question": "Anyone there?"}, timeout=30)
    assert response.status_code in (200, 502, 503), response.text  # 502: a request the router could not place
    return (response.status_code == 503 and int(response.headers["retry-after"]) > 0
            and response.json()["error"]["type"] == "service_unavailable")


def readyz(server: AppServer) -> dict:
    return httpx.get(f"{server.url}/readyz", timeout=10).json()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout}s for {what}")
        time.sleep(0.5)
