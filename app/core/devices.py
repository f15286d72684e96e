"""Where torch work runs: one GPU check for the vLLM launcher (CUDA build or CPU build) and the encoder's device."""

from __future__ import annotations


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a broken torch build means no GPU path either
        return False


def torch_device(device: str) -> str:
    """``device``, with 'auto' settled: the GPU where torch sees one (a question's encoding there costs a
    fraction of the CPU's, which sets the pace of retrieval on a busy host), else the CPU."""
    if device != "auto":
        return device
    return "cuda" if has_cuda() else "cpu"


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (Intel AMX, AVX512-BF16): Linux's CPU flags; elsewhere no."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def query_dtype(dtype: str, device: str) -> str:
    """The question encoder's number format on ``device`` (settled: ``torch_device``), with 'auto' settled:
    bfloat16 on a CPU that has it natively."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device == "cpu" and cpu_has_bf16() else "float32"


def query_runtime(runtime: str, dtype: str, device: str) -> str:
    """What runs the question encoder on ``device`` (settled: ``torch_device``), with 'auto' settled: ONNX
    Runtime on the CPU, unless the encoder is asked for in bfloat16 (torch's CPU kernels run that)."""
    if runtime != "auto":
        return runtime
    return "onnx" if device == "cpu" and dtype != "bfloat16" else "torch"
