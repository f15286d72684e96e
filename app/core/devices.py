"""Where torch work runs: one GPU check for the vLLM launcher (CUDA build or CPU build) and the encoder's device."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.core.settings_corpus import EmbeddingSettings


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch build means no GPU path either
        return False


def torch_device(device: str) -> str:
    """``device``, with 'auto' settled: the GPU where torch sees one (ingest's batches encode there many times
    faster; a question's encoding beside a busy vLLM takes about what the CPU's does, docs/benchmarks.md), else
    the CPU."""
    if device != "auto":
        return device
    return "cuda" if has_cuda() else "cpu"


def query_encoder(settings: EmbeddingSettings) -> tuple[str, str, str]:
    """(runtime, number format, device) of the service's question encoder, 'auto' settled as far as settings
    can: ONNX Runtime for int8 (only it runs that); torch on a GPU or in bfloat16; 'either' in float32 on the
    CPU, for the encoder to time both at load. ONNX Runtime runs on the CPU."""
    dtype, device, runtime = settings.query_dtype, torch_device(settings.device), str(settings.query_runtime)
    if runtime == "auto":
        runtime = "onnx" if dtype == "int8" else "either" if device == "cpu" and dtype == "float32" else "torch"
    return runtime, dtype, device if runtime == "torch" else "cpu"
