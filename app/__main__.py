"""``python -m app``: serve ``create_app(Settings())`` with uvicorn."""

from __future__ import annotations

import logging
import sys

import uvicorn
from pydantic import ValidationError


def main() -> int:
    from app.main import create_app
    from app.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        first = exc.errors()[0]
        print(f"error: invalid setting {'.'.join(map(str, first['loc']))}: {first['msg']}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: the readiness and collection polls would drown what happens. Our own
    # monitors log state changes instead.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    # SIGTERM: stop accepting, let requests in flight finish for drain_s, then cut them off (closing their
    # vLLM requests, which vLLM then aborts) and exit.
    uvicorn.run(create_app(settings), host=settings.service.host, port=settings.service.port, log_level="info",
                timeout_graceful_shutdown=settings.traffic.drain_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
