"""Write docs/configuration.md from the settings themselves (``app.core.settings.Settings``): every variable,
its default and its description, so the page cannot drift from the code. ``--check`` fails if it has.

    .venv/bin/python scripts/settings_doc.py [--check]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import BaseModel

from app.core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "configuration.md"
HEAD = """# Configuration

One pydantic-settings object, `app/core/settings.py`: environment variables under the prefix `PREFIXRAG_`, nested
sections joined by `__` (`PREFIXRAG_LIMITS__MAX_TOKENS=128`), a `.env` file in the working directory read too, and
every value validated at start-up (a bad one stops the process with one line naming it; so does a name under the
prefix that is no setting, with the closest valid one: `PREFIXRAG_SERVICE__PROT` → `PREFIXRAG_SERVICE__PORT`). The
everyday ones also have a flat alias (`PREFIXRAG_VLLM_URL`, `PREFIXRAG_CHROMA_PATH`, `PREFIXRAG_COLLECTION`,
`PREFIXRAG_MODEL`, `PREFIXRAG_TOP_K`, `PREFIXRAG_API_KEY`). `python -m app --help`, `python -m ingest --help` and
`python -m app.vllm_server --help` list the flags that override the few settings a person changes at the command
line.

The prefix was `RAG_` before release 0.2, which Open WebUI's own settings share (`RAG_TOP_K`,
`RAG_EMBEDDING_MODEL`): this release still reads a `RAG_` name of one of these settings, where its `PREFIXRAG_` name
is not set, and logs a warning naming the new one; other `RAG_` names are left alone. The next release reads
`PREFIXRAG_` only.

This page is written by `scripts/settings_doc.py` from the settings' own descriptions.
"""


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str]]:
    found = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            found += rows(kind, f"{prefix}{name.upper()}__")
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, Path) and default.is_relative_to(ROOT):  # the checkout's own folder, wherever it is
            default = default.relative_to(ROOT)
        found.append((f"{prefix}{name.upper()}", "" if default is None else f"`{default}`",
                      (field.description or "").replace("|", "\\|")))
    return found


def page() -> str:
    sections: dict[str, list[tuple[str, str, str]]] = {}
    for variable, default, description in rows(Settings, "PREFIXRAG_"):
        section = variable.split("__")[0] if "__" in variable else "flat aliases"
        sections.setdefault(section, []).append((variable, default, description))
    parts = [HEAD]
    for section, found in sections.items():
        parts.append(f"\n## `{section}`\n\n| variable | default | what it does |\n| --- | --- | --- |")
        parts += [f"| `{variable}` | {default} | {description} |" for variable, default, description in found]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if docs/configuration.md is not up to date")
    args = parser.parse_args(argv)
    if args.check:
        if PAGE.read_text() != page():
            print(f"error: {PAGE} is out of date: run python scripts/settings_doc.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page())
    return 0


if __name__ == "__main__":
    sys.exit(main())
