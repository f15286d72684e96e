"""vLLM's front end in several processes (``--api-server-count N``, as ``vllm serve`` runs it) with the
detokenizer fix of ``app.vllm.entry`` in each: vLLM spawns its API servers as fresh interpreters, so the fix is
installed by the function each of them starts with, which then runs vLLM's own."""

from __future__ import annotations

import os
from typing import Any

from app.vllm.entry import PRIME_ENV, bound_detokenizer_priming

ORIGINAL = "_prefixrag_original_api_server"  # where install() keeps vLLM's own function, in the launching process


def primed_api_server(*args: Any, **kwargs: Any) -> None:
    """One API server process: prime with the prompt's tail (as configured), then vLLM's server as it is."""
    from vllm.v1 import utils

    tail = int(os.environ.get(PRIME_ENV) or 0)
    if tail > 0:
        applied = bound_detokenizer_priming(tail)
        print(f"[prefixrag] API server {os.getpid()}: detokenizer primed with the prompt's last {tail} tokens: "
              f"{'on' if applied else 'not applicable to this vLLM'}", flush=True)
    getattr(utils, ORIGINAL, utils.run_api_server_worker_proc)(*args, **kwargs)


def install() -> None:
    """In vLLM's launching process: every API server it spawns from now on starts in ``primed_api_server``
    (vLLM's process manager reads the module's function when it spawns one)."""
    from vllm.v1 import utils

    if utils.run_api_server_worker_proc is not primed_api_server:
        setattr(utils, ORIGINAL, utils.run_api_server_worker_proc)
        utils.run_api_server_worker_proc = primed_api_server
