"""Prompt templates as data (``prompts/*.toml``), loaded once; one strict renderer.

Values are substituted in a single pass with ``string.Template``: a missing variable raises, and text that
arrives inside a value (a document, a question) is never parsed as a template itself.
"""

from __future__ import annotations

import re
import string
import tomllib
from dataclasses import dataclass
from pathlib import Path

REQUIRED = {("system", "text"), ("context", "block"), ("context", "document"), ("context", "unit"),
            ("context", "empty"), ("question", "text"), ("question", "client_instructions")}
# Strings a chat template or tokenizer treats as structure: role markers / special tokens and our delimiters.
_SPECIAL = re.compile(r"<\|(?=[^<>]{0,40}\|>)|\|>")
_DELIMITER = re.compile(r"<(/?)(documents?)\b", re.IGNORECASE)


class TemplateError(Exception):
    """A template file is missing, incomplete, or was rendered without one of its variables."""


def inert(text: str) -> str:
    """Neutralise delimiters and role markers inside untrusted text, keeping it readable.

    ``<|im_start|>`` becomes ``<\\|im_start|\\>`` (not one special token any more, nor the text of a template's
    marker) and ``</document>`` becomes ``&lt;/document>`` so a chunk can neither close its block nor open a new
    chat turn. The escape is visible: a tokenizer's normalisation drops zero-width characters (BERT's does), so a
    zero-width break would tokenize exactly as the marker it was meant to break.
    """
    text = _SPECIAL.sub(lambda m: "<\\|" if m.group(0) == "<|" else "|\\>", text)
    return _DELIMITER.sub(lambda m: f"&lt;{m.group(1)}{m.group(2)}", text)


class Neutraliser:
    """``inert`` plus the served model's own special tokens (``[SEP]``, ``<s>``, ``[INST]``, ``<start_of_turn>``
    ...), as vLLM's tokenizer lists them: each is broken by a backslash after its first character (``[\\SEP]``),
    so text can never carry one."""

    def __init__(self) -> None:
        self.served: tuple[str, ...] = ()  # as last given; the pattern is rebuilt only when they change
        self._pattern: re.Pattern[str] | None = None

    def use(self, tokens: tuple[str, ...]) -> None:
        """Adopt the served tokenizer's special tokens (``Upstream`` publishes them whenever they change)."""
        if tokens == self.served:
            return
        self.served = tokens
        wanted = sorted({t for t in tokens if len(t.strip()) > 1}, key=lambda t: (-len(t), t))  # longest first
        self._pattern = re.compile("|".join(map(re.escape, wanted)), re.IGNORECASE) if wanted else None

    def __call__(self, text: str) -> str:
        text = inert(text)
        return self._pattern.sub(lambda m: m.group(0)[0] + "\\" + m.group(0)[1:], text) if self._pattern else text

    def attribute(self, text: str) -> str:
        return self(text).replace('"', "&quot;").replace("\n", " ")


@dataclass(frozen=True)
class PromptTemplates:
    parts: dict[tuple[str, str], string.Template]

    @classmethod
    def load(cls, directory: Path, name: str = "rag") -> PromptTemplates:
        path = Path(directory) / f"{name}.toml"
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise TemplateError(f"cannot load prompt templates {path}: {exc}") from exc
        parts = {(section, key): string.Template(value) for section, table in data.items()
                 if isinstance(table, dict) for key, value in table.items() if isinstance(value, str)}
        missing = REQUIRED - parts.keys()
        if missing:
            raise TemplateError(f"{path} lacks {sorted('.'.join(m) for m in missing)}")
        return cls(parts)

    def render(self, section: str, key: str, **values: object) -> str:
        try:
            return self.parts[(section, key)].substitute(values)
        except KeyError as exc:
            raise TemplateError(f"template {section}.{key} needs variable {exc.args[0]!r}") from None
        except ValueError as exc:
            raise TemplateError(f"template {section}.{key}: {exc}") from None
