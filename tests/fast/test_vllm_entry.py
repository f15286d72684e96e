"""``app.vllm.entry``: vLLM's streaming detokenizer primed with the prompt's tail emits exactly the text it emits
primed with the whole prompt, on the real vLLM class and real tokenizers (WordPiece: the test model's; byte-level
BPE: SmolLM2's, as Llama 3 and Qwen use), long prompts, multi-byte characters and special tokens included.
(prefixrag's prompts end with the chat template's assistant header, never inside a character.)"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

from app.vllm.entry import bound_detokenizer_priming, tail_primed
from app.vllm.smollm2 import packaged_gguf
from app.vllm.testmodel import write_test_model

TAIL = 16  # small, so that the primed tail starts inside words and multi-byte characters
PROSE = ("Configure sys.path at initialisation: PYTHONPATH, the site module and ._pth files. "
         "Naïve café — 日本語のテキスト ✓ 🙂 and the numbers 3.14159, 1e-9, 0x1F600. ") * 40


@pytest.fixture(scope="module", params=["wordpiece", "byte-level-bpe"])
def tokenizer(request, tmp_path_factory):
    if request.param == "wordpiece":
        return request.param, AutoTokenizer.from_pretrained(write_test_model(tmp_path_factory.mktemp("tiny")))
    gguf = packaged_gguf()
    return request.param, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


class TailPrimed(FastIncrementalDetokenizer):
    __init__ = tail_primed(FastIncrementalDetokenizer.__init__, TAIL)


def streamed_text(detokenizer_class, tokenizer, prompt: list[int], output: list[int], skip_special: bool) -> str:
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=prompt, mm_features=None, lora_request=None, cache_salt=None,
        sampling_params=SamplingParams(max_tokens=len(output), skip_special_tokens=skip_special),
        pooling_params=None, arrival_time=0.0, data_parallel_rank=None)
    detokenizer = detokenizer_class(tokenizer, request)
    pieces = []
    for token in output:
        detokenizer.update([token], stop_terminated=False)
        pieces.append(detokenizer.get_next_output_text(finished=False, delta=True))
    return "".join(pieces) + detokenizer.get_next_output_text(finished=True, delta=True)


@pytest.mark.parametrize("skip_special", [True, False])
def test_tail_priming_streams_the_same_text_as_whole_prompt_priming(tokenizer, skip_special):
    kind, tokenizer = tokenizer
    ids = tokenizer(PROSE, add_special_tokens=False)["input_ids"]
    special = [tokenizer.eos_token_id or tokenizer.sep_token_id]
    cases, split_characters = 0, 0
    for cut in range(200, 1200, 37):  # boundaries inside words; primed tails starting inside multi-byte characters
        if tokenizer.decode(ids[:cut]).endswith("\ufffd"):
            continue  # a prompt ending inside a character: upstream streams the whole prompt (vllm#48853)
        prompt, output = ids[:cut], ids[cut:cut + 48] + special + ids[cut + 48:cut + 60]
        whole = streamed_text(FastIncrementalDetokenizer, tokenizer, prompt, output, skip_special)
        assert streamed_text(TailPrimed, tokenizer, prompt, output, skip_special) == whole, cut
        cases += bool(whole.strip())
        split_characters += tokenizer.decode(prompt[-TAIL:]).startswith("\ufffd")
    assert cases > 20  # the comparison ran on real text, not on empty strings
    assert split_characters >= 1 or kind == "wordpiece"  # WordPiece tokens hold whole characters


def test_the_fix_applies_to_the_installed_vllm(monkeypatch):
    """If vLLM stops priming with the whole prompt (the fix merged upstream), this fails: drop app.vllm.entry."""
    monkeypatch.setattr(FastIncrementalDetokenizer, "__init__", FastIncrementalDetokenizer.__init__)
    assert bound_detokenizer_priming(128)
    assert FastIncrementalDetokenizer.__init__.__qualname__.startswith("tail_primed")
