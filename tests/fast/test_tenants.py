"""The fast tier, tenants (``PREFIXRAG_SERVICE__KEYS_FILE``): a key reads only its tenant's collections (another
one is not found), writes only if allowed, and its prompts carry a cache salt of the tenant's own, set by the
server (a client's is ignored), so one tenant's cached context is never hit by another's request. Real app,
on-disk Chroma and embedder; the fake vLLM, which hashes its blocks with the salt as vLLM does. The same against
the real vLLM's counters: ``tests/vllm/test_tenants.py``."""

from __future__ import annotations

import json

import httpx
import pytest

from app.serve.app import create_app
from tests.support.corpora import app_settings
from tests.support.fakes import FakeVLLM
from tests.support.servers import AppServer

TENANTS = {"tenants": [
    {"name": "alpha", "keys": ["key-alpha"], "collections": ["notes"], "write": True},
    {"name": "beta", "keys": ["key-beta", "key-beta-2"], "collections": ["elsewhere"], "write": True},
    {"name": "gamma", "keys": ["key-gamma"]},  # every collection, read only
]}


def call(server, method: str, path: str, key: str, **kwargs) -> httpx.Response:
    return httpx.request(method, server.url + path, headers={"authorization": f"Bearer {key}"}, timeout=60, **kwargs)


def test_a_key_reads_its_tenants_collections_writes_if_allowed_and_caches_apart(notes, embedder, tmp_path):
    chroma, texts, _ = notes
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(TENANTS))
    settings = app_settings(chroma, "http://unused/v1", collection="notes", hotness_dir=None, top_k=2)
    settings.service.keys_file = keys
    fake = FakeVLLM()
    question = {"question": texts["para-002"][:200], "max_tokens": 4}
    with AppServer(create_app(settings, embedder=embedder, llm=fake)) as server:
        server.wait_ready()
        statuses = {
            "no key": httpx.post(server.url + "/ask", json=question, timeout=30).status_code,
            "unknown key": call(server, "POST", "/ask", "key-nobody", json=question).status_code,
            "beta asks": call(server, "POST", "/ask", "key-beta-2", json=question).status_code,
            "beta retrieves": call(server, "POST", "/v1/retrieve", "key-beta", json={"question": "x"}).status_code,
            "beta lists": call(server, "GET", "/v1/documents", "key-beta").status_code,
            "gamma lists": call(server, "GET", "/v1/documents", "key-gamma").status_code,
            "gamma deletes": call(server, "DELETE", "/v1/documents/para-001", "key-gamma").status_code,
            "gamma uploads": call(server, "POST", "/v1/documents", "key-gamma",
                                  files=[("files", ("a.md", b"# A\n"))]).status_code,
            "beta describes": call(server, "GET", "/v1/collections/notes", "key-beta").status_code,
        }
        collections = {key: [c["id"] for c in call(server, "GET", "/v1/collections", key).json()["data"]]
                       for key in ("key-alpha", "key-beta", "key-gamma")}
        alpha = [call(server, "POST", "/ask", "key-alpha", json=question).json()["usage"] for _ in range(2)]
        gamma = call(server, "POST", "/ask", "key-gamma", json=question).json()["usage"]
        chat = call(server, "POST", "/v1/chat/completions", "key-alpha", json={
            "model": "prefixrag", "max_tokens": 4, "cache_salt": "the-client-s-own", "prompt_cache_key": "its-hint",
            "messages": [{"role": "user", "content": question["question"]}]})
    assert statuses == {"no key": 401, "unknown key": 401, "beta asks": 404, "beta retrieves": 404,
                        "beta lists": 404, "gamma lists": 200, "gamma deletes": 403, "gamma uploads": 403,
                        "beta describes": 404}
    assert collections == {"key-alpha": ["notes"], "key-beta": [], "key-gamma": ["notes"]}
    assert chat.status_code == 200, chat.text
    salts = fake.salts[-4:]  # alpha, alpha, gamma, alpha's chat
    assert salts[0] == salts[1] == salts[3] and salts[0] not in (None, salts[2]) and salts[2] is not None
    assert not {"the-client-s-own", "its-hint"} & set(fake.salts)  # a client's hint is never a salt either
    assert alpha[1]["cached_tokens"] >= alpha[1]["prompt_tokens"] // 2  # alpha's own second ask hits alpha's
    assert gamma["cached_tokens"] == 0  # ... and gamma's first ask, the same prompt, hits nothing of it


def test_a_keys_file_that_cannot_be_used_fails_at_start_naming_it(tmp_path, embedder):
    settings = app_settings(tmp_path / "chroma", "http://unused/v1", hotness_dir=None)
    bad = {"not json": "{", "a key twice": json.dumps({"tenants": [{"name": "a", "keys": ["k"]},
                                                                    {"name": "b", "keys": ["k"]}]}),
           "no keys": json.dumps({"tenants": [{"name": "a", "keys": []}]})}
    for why, content in bad.items():
        settings.service.keys_file = tmp_path / f"{why}.json"
        settings.service.keys_file.write_text(content)
        with pytest.raises(ValueError, match=str(settings.service.keys_file)):
            create_app(settings, embedder=embedder, llm=FakeVLLM())
