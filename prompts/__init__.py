"""Prompt templates as data (``rag.toml``). This file only makes them ship with the package, so a wheel install
finds them beside ``app/`` as a checkout does."""
