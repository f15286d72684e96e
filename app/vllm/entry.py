"""``python -m app.vllm.entry [vLLM flags]``: vLLM's OpenAI server with one fix to its front end for long prompts.

Since vllm-project/vllm#34217 (every vLLM we run: 0.26 CUDA, 0.32 CPU) the API server primes each request's
incremental detokenizer with the *whole* prompt, and that prime is decoded when the first output token arrives, on
the API server's event loop: O(prompt) work inside every request's TTFT that also holds up every other stream.
prefixrag's prompts are long and mostly cached, so this is where their first token waits (a 4.4K-token prompt:
5 ms on a 2-core CPU; README, "Serving vLLM"). Decoding a continuation needs only a short left context, so
the detokenizer is primed with the prompt's last tokens instead — the change proposed upstream in
vllm-project/vllm#51281 and #57330 (open). The fix applies only where vLLM's code still primes with the whole
prompt. It is installed in this process, which is the only API server: this module runs vLLM's single-worker
server (``run_server``), where ``--api-server-count`` has no effect (only ``vllm serve`` spawns more).

``app.vllm.launcher`` starts vLLM through this module; ``RAG_VLLM_SERVER__DETOKENIZER_PRIME_TOKENS=0`` leaves vLLM
as it is.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
from collections.abc import Callable

PRIME_ENV = "PREFIXRAG_DETOKENIZER_PRIME_TOKENS"  # set by app.vllm.launcher from its settings
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WHOLE_PROMPT_PRIME = "ids=request.prompt_token_ids"  # the upstream line this replaces


def tail_primed(upstream_init: Callable, tail: int) -> Callable:
    """``FastIncrementalDetokenizer.__init__`` that primes the decode stream with the prompt's last ``tail`` ids."""
    import tokenizers.decoders

    def __init__(self, tokenizer, request) -> None:
        upstream_init(self, tokenizer, request)  # cheap: the whole-prompt prime is decoded lazily, on first step
        prompt = request.prompt_token_ids or []
        if len(prompt) > tail:
            # A tail that starts inside a multi-byte character is fine: its prefix and every later decode begin
            # with the same replacement character, and only the difference is streamed (tests/fast/test_vllm_entry.py).
            self.stream = tokenizers.decoders.DecodeStream(ids=prompt[-tail:],
                                                           skip_special_tokens=self.skip_special_tokens)

    return __init__


def bound_detokenizer_priming(tail: int) -> bool:
    """Install ``tail_primed`` in vLLM; False (and nothing changed) where vLLM does not prime with the whole prompt."""
    from vllm.v1.engine import detokenizer

    detokenizer_class = getattr(detokenizer, "FastIncrementalDetokenizer", None)
    if detokenizer_class is None or WHOLE_PROMPT_PRIME not in inspect.getsource(detokenizer_class.__init__):
        return False  # another vLLM: its priming is not the one measured, so leave it alone
    detokenizer_class.__init__ = tail_primed(detokenizer_class.__init__, tail)
    return True


def main() -> None:
    tail = int(os.environ.get(PRIME_ENV) or 0)
    if tail > 0:
        applied = bound_detokenizer_priming(tail)
        print(f"[prefixrag] detokenizer primed with the prompt's last {tail} tokens: "
              f"{'on' if applied else 'not applicable to this vLLM'}", flush=True)
    sys.argv = [VLLM_SERVER_MODULE, *sys.argv[1:]]
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
