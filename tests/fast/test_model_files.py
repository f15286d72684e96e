"""The served model's files found on this machine (``app.vllm.model_files``): in the folder vLLM serves from, or,
for a Hugging Face id, in the local Hugging Face cache (the compose file shares vLLM's cache with the service);
token-id prompts and the KV tier's size read them from either."""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace

import huggingface_hub.constants

from app.core.settings import VLLMSettings
from app.vllm.kv_tiers import model_config
from app.vllm.model_files import local_folder
from app.vllm.prompt_ids import PromptIds
from app.vllm.testmodel import write_test_model


def cached_as(hub, repo_id: str, folder) -> None:
    """``folder``'s files as the Hugging Face cache holds a download of ``repo_id``: a snapshot and refs/main."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / "0123abc")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")


def tokenizer_from(root: str) -> bool:
    async def load() -> bool:
        prompt_ids = PromptIds(VLLMSettings(), llm=None)
        prompt_ids.adopt(SimpleNamespace(root=root))  # as vLLM is first seen
        await prompt_ids.learn([], "")  # returns once the load has ended
        prompt_ids.close()
        return prompt_ids.active

    return asyncio.run(load())


def test_a_hub_id_in_the_local_cache_gives_the_tokenizer_and_the_config(tmp_path, monkeypatch):
    model, hub = write_test_model(tmp_path / "model"), tmp_path / "hub"
    cached_as(hub, "acme/tiny-chat", model)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    snapshot = hub / "models--acme--tiny-chat" / "snapshots" / "0123abc"
    assert local_folder("acme/tiny-chat") == snapshot and local_folder(str(model)) == model
    assert model_config("acme/tiny-chat") == model_config(str(model)) is not None
    assert local_folder("acme/not-downloaded") is None and local_folder("") is None
    assert tokenizer_from("acme/tiny-chat") and tokenizer_from(str(model))
    assert not tokenizer_from("acme/not-downloaded")
