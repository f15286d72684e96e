"""``python -m app.cluster``: the entry point users call; the code lives in ``app.vllm.cluster``."""

import sys

from app.vllm.cluster import main

if __name__ == "__main__":
    sys.exit(main())
