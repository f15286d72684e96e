"""``prefixrag serve|ingest|vllm|cluster [...]``: the console script, one name for every entry point. Each
subcommand is the matching ``python -m`` form with the same flags (``prefixrag ingest --help``)."""

from __future__ import annotations

import sys

COMMANDS = {
    "serve": ("app.__main__", "the query service (python -m app)"),
    "ingest": ("ingest.cli", "load, chunk, embed and upsert documents (python -m ingest)"),
    "vllm": ("app.vllm_server", "start vLLM with prefixrag's flags (python -m app.vllm_server)"),
    "cluster": ("app.cluster", "N vLLM replicas + vllm-router + Chroma + the app (python -m app.cluster)"),
}


def usage() -> str:
    lines = ["usage: prefixrag {" + ",".join(COMMANDS) + "} [options]  |  prefixrag --version", ""]
    lines += [f"  {name:<8} {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from app.core.version import version

        print(f"prefixrag {version()}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
