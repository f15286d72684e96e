"""Where the served model's own files are on this machine: in the folder vLLM serves it from (its ``/v1/models``
root), or, for a Hugging Face id, in the local Hugging Face cache (a service beside a vLLM that downloaded the model
into a cache both can read, as the compose file's shared volume is). Nothing is ever downloaded here."""

from __future__ import annotations

from pathlib import Path


def local_file(model_root: str, name: str) -> Path | None:
    """The model's file ``name`` (e.g. ``config.json``): in the folder ``model_root``, else in the local cache of
    the hub id ``model_root``; None where neither has it."""
    if not model_root:
        return None
    path = Path(model_root) / name
    if path.is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_root, name)
    except Exception:  # not a hub id either
        return None
    return Path(found) if isinstance(found, str) else None


def local_folder(model_root: str, marker: str = "tokenizer_config.json") -> Path | None:
    """The folder holding the model's files (its snapshot in the cache for a hub id), found by ``marker``."""
    found = local_file(model_root, marker)
    return found.parent if found is not None else None
