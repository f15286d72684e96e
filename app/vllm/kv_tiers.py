"""vLLM's host-memory KV tier in tokens: what pre-warm may keep warm beyond the GPU's own cache.

vLLM started with ``--kv-offloading-size GIB`` (its native CPU offloading connector; ``python -m app.vllm_server
--kv-offload-gib``) copies every cached block to pinned host memory and, when a prompt misses the GPU's cache,
loads the blocks it finds there instead of computing them again. vLLM reports the tier only in GiB
(``kv_offloading_size`` in ``vllm:cache_config_info``); one token's KV takes 2 (K and V) x layers x KV heads x
head size x bytes per value, read from the served model's ``config.json`` where it can be read here (a local
folder, or a Hugging Face id in the local cache). Where it cannot, the tier counts as 0 (pre-warm keeps to the
GPU's cache, as without a tier), and that is logged once.
"""

from __future__ import annotations

import json
import logging
from functools import lru_cache
from typing import Any

from app.vllm.model_files import local_file

log = logging.getLogger("prefixrag.upstream")

VALUE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}


def host_tier_gib(cache_config: dict[str, str]) -> float:
    """The host tier's size in GiB from ``vllm:cache_config_info``'s labels (0: no tier)."""
    try:
        return float(cache_config.get("kv_offloading_size") or 0)
    except ValueError:  # "None": offloading off
        return 0.0


@lru_cache(maxsize=8)
def host_tier_tokens(gib: float, model_root: str, cache_dtype: str) -> int:
    """Tokens the host tier holds for this model (0 where its KV size per token cannot be read here)."""
    if gib <= 0:
        return 0
    config = model_config(model_root)
    per_token = kv_bytes_per_token(config, cache_dtype) if config else None
    if not per_token:
        log.warning("vLLM keeps a %.0f GiB KV tier in host memory, but the served model's config.json (%r) cannot "
                    "be read here: pre-warm keeps to the GPU's cache", gib, model_root)
        return 0
    return int(gib * (1 << 30) // per_token)


def kv_bytes_per_token(config: dict[str, Any], cache_dtype: str) -> int | None:
    """2 x layers x KV heads x head size x bytes per value; None where the config lacks a dimension."""
    config = config.get("text_config", config)  # multimodal configs nest the language model's
    layers, heads = config.get("num_hidden_layers"), config.get("num_attention_heads")
    hidden = config.get("hidden_size")
    if not (layers and heads and hidden):
        return None
    kv_heads = config.get("num_key_value_heads") or heads
    head_size = config.get("head_dim") or hidden // heads
    if cache_dtype.startswith("fp8"):
        value = 1
    else:
        value = VALUE_BYTES.get(cache_dtype if cache_dtype != "auto" else str(config.get("torch_dtype")
                                                                               or config.get("dtype")), 2)
    return int(2 * layers * kv_heads * head_size * value)


def model_config(model_root: str) -> dict[str, Any] | None:
    """The model's config.json: in the folder vLLM loads it from, or in the local Hugging Face cache."""
    path = local_file(model_root, "config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError):
        return None
