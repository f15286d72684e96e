"""GET / : the chat page (static files, no build step). It calls /v1/chat/completions like any frontend."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

STATIC = Path(__file__).resolve().parent.parent / "static"
FILES = {"app.js": "text/javascript", "style.css": "text/css",  # vendored: static/vendor/README.md
         "vendor/marked.umd.js": "text/javascript", "vendor/purify.min.js": "text/javascript"}

router = APIRouter(tags=["page"])


@router.get("/", include_in_schema=False)
async def index() -> FileResponse:
    return FileResponse(STATIC / "index.html", media_type="text/html")


@router.get("/static/{name:path}", include_in_schema=False)
async def static(name: str) -> FileResponse:
    from app.core.errors import NotFound

    if name not in FILES:  # a fixed list: no path traversal possible
        raise NotFound(f"no static file {name!r}")
    return FileResponse(STATIC / name, media_type=FILES[name])
