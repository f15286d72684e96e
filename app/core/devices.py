"""Where torch work runs: one GPU check for the vLLM launcher (CUDA build or CPU build) and the encoder's device."""

from __future__ import annotations


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


def query_runtime(runtime: str, dtype: str, device: str) -> str:
    """What runs the question encoder on ``device`` (settled: ``torch_device``), with 'auto' settled as far as
    settings can: torch on a GPU or in bfloat16; 'either' where both run it (float32 on the CPU), for the
    encoder to time at load."""
    if runtime != "auto":
        return runtime
    return "either" if device == "cpu" and dtype == "float32" else "torch"
