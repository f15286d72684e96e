"""``python -m app.vllm_server``: the entry point users call; the code lives in ``app.vllm.launcher``."""

import sys

from app.vllm.launcher import main

if __name__ == "__main__":
    sys.exit(main())
