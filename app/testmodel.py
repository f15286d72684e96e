"""``python -m app.testmodel``: the entry point users call; the code lives in ``app.vllm.testmodel``."""

from app.vllm.testmodel import main

if __name__ == "__main__":
    main()
