"""Tenants against a real vLLM CPU server: the cache salt the service sets per tenant keeps one tenant's cached
context out of another's reach, read from vLLM's own counts (``usage.prompt_tokens_details.cached_tokens``)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from app.serve.app import create_app
from tests.support.corpora import app_settings, floor_block
from tests.support.servers import AppServer, reset_prefix_cache

pytestmark = pytest.mark.vllm


def test_the_same_question_hits_its_tenants_cache_and_never_another_tenants(collections, vllm_url, embedder,
                                                                            tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "alpha", "keys": ["key-alpha"]},
                                            {"name": "beta", "keys": ["key-beta"]}]}))
    settings = app_settings(collections, vllm_url, collection="project-docs", hotness_dir=None, top_k=3)
    settings.service.keys_file = keys
    reset_prefix_cache(vllm_url)
    with AppServer(create_app(settings, embedder=embedder)) as server:
        server.wait_ready()
        deadline, alpha_key = time.monotonic() + 120, {"authorization": "Bearer key-alpha"}
        while (ready := httpx.get(server.url + "/readyz", headers=alpha_key, timeout=10).json())["warmup"][
                "state"] != "done":
            assert time.monotonic() < deadline, ready
            time.sleep(0.2)
        block = ready["vllm"]["block_size"]

        def ask(key: str) -> dict:
            answer = httpx.post(server.url + "/ask", json={"question": "How does pre-warm avoid delaying users?",
                                                           "max_tokens": 4},
                                headers={"authorization": f"Bearer {key}"}, timeout=300)
            assert answer.status_code == 200, answer.text
            return answer.json()["usage"]

        alpha, alpha_again, beta = ask("key-alpha"), ask("key-alpha"), ask("key-beta")
    assert alpha["prompt_tokens"] == alpha_again["prompt_tokens"] == beta["prompt_tokens"]  # one prompt
    assert alpha["cached_tokens"] == 0  # salted: not even the pre-warmed (unsalted) system prompt
    assert alpha_again["cached_tokens"] >= floor_block(alpha["prompt_tokens"] - 64, block) > 0
    assert beta["cached_tokens"] == 0  # alpha's blocks, the same tokens, are not beta's
