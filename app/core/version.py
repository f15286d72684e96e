"""The installed release, for every entry point's ``--version``."""

from __future__ import annotations

import argparse
from importlib import metadata


def version() -> str:
    try:
        return metadata.version("prefixrag")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def add_version(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    return parser
