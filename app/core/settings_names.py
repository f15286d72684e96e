"""The environment's names for settings. Our own prefix is ``PREFIXRAG_``: a name under it that is no setting
(``PREFIXRAG_SERVICE__PROT``) is refused at start-up with the closest valid one, never silently ignored. The old
prefix ``RAG_`` is read for this release, with a warning; it is shared with Open WebUI's own settings
(``RAG_TOP_K``, ``RAG_EMBEDDING_MODEL``), so an old name that is no setting of ours is left alone."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping

from pydantic import AliasChoices, BaseModel
from pydantic_settings import BaseSettings

PREFIX, LEGACY = "PREFIXRAG_", "RAG_"
# Ours but not settings: compose's image tag, and what the vLLM launcher hands its child process.
NOT_SETTINGS = frozenset({"PREFIXRAG_TAG", "PREFIXRAG_DETOKENIZER_PRIME_TOKENS"})
log = logging.getLogger("prefixrag.settings")
_warned: set[str] = set()


class UnknownSetting(ValueError):
    """A variable under our prefix that names no setting."""


def known_names(settings: type[BaseSettings]) -> set[str]:
    """Every variable name that sets something: a section (as JSON), a section's field, a flat alias."""
    names = set()
    for name, field in settings.model_fields.items():
        if isinstance(field.validation_alias, AliasChoices):
            names |= {str(alias) for alias in field.validation_alias.choices}
            continue
        names.add(PREFIX + name.upper())
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            names |= {f"{PREFIX}{name.upper()}__{sub.upper()}" for sub in field.annotation.model_fields}
    return names


def adopted(variables: Mapping[str, str | None], known: set[str], where: str) -> dict[str, str | None]:
    """``variables`` (as a settings source read them: any case) once every name under our prefix is checked to
    be a setting, with each old-prefix name of a setting added under ours where ours is not set."""
    by_name = {name.upper(): name for name in variables}
    for name in by_name:
        if name.startswith(PREFIX) and name not in known and name not in NOT_SETTINGS:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise UnknownSetting(f"unknown setting {name} ({where})" + (f"; did you mean {close[0]}?" if close else ""))
    found = dict(variables)
    for name, given in by_name.items():
        new = PREFIX + name.removeprefix(LEGACY)
        if name.startswith(LEGACY) and new in known and new not in by_name:
            found[new if given.isupper() else new.lower()] = variables[given]
            if name not in _warned:
                _warned.add(name)
                log.warning("%s is read as %s for this release only: rename it (%s)", name, new, where)
    return found
