"""Visible text of an HTML page, split at headings, through a real parser (BeautifulSoup + lxml)."""

from __future__ import annotations

import re

from bs4 import BeautifulSoup, Comment, Tag
from bs4.element import NavigableString

# Never visible, or page furniture rather than content.
_DROP_TAGS = ("script", "style", "noscript", "template", "svg", "nav", "header", "footer", "aside", "form",
              "iframe", "button", "head")
_DROP_ROLES = ("navigation", "banner", "contentinfo", "search", "complementary")
_SPACES = re.compile(r"[ \t\r\f\v]+|\n+")
_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
_BLOCKS = {"p", "div", "li", "ul", "ol", "pre", "table", "tr", "br", "dt", "dd", "dl", "section", "article",
           "blockquote", "main", "figure", "figcaption", "hr", "td", "th"} | set(_HEADINGS)


def html_to_blocks(markup: str) -> tuple[str, list[tuple[tuple[str, ...], str, None]]]:
    soup = BeautifulSoup(markup, "lxml")
    title = soup.title.get_text(" ", strip=True) if soup.title else ""
    _drop_furniture(soup)
    root = soup.find("main") or soup.find(None, {"role": "main"}) or soup.body or soup
    walker = _Walker()
    walker.walk(root)
    blocks = walker.finish()
    if not title:
        first = root.find("h1")
        title = first.get_text(" ", strip=True) if first else ""
    return title, blocks


def _drop_furniture(soup: BeautifulSoup) -> None:
    for tag in soup.find_all(_DROP_TAGS):
        tag.decompose()
    for tag in soup.find_all(None, {"role": list(_DROP_ROLES)}):
        tag.decompose()
    for tag in soup.find_all(None, {"hidden": True}):
        tag.decompose()
    for tag in soup.find_all(None, {"aria-hidden": "true"}):
        tag.decompose()
    for anchor in soup.select("a.headerlink"):  # Sphinx's pilcrow permalinks
        anchor.decompose()
    for comment in soup.find_all(string=lambda s: isinstance(s, Comment)):
        comment.extract()


class _Walker:
    """Depth-first walk that starts a new block at every heading and keeps the heading path."""

    def __init__(self) -> None:
        self.blocks: list[tuple[tuple[str, ...], str, None]] = []
        self.path: list[tuple[int, str]] = []
        self.parts: list[str] = []

    def walk(self, node: Tag) -> None:
        for child in node.children:
            if isinstance(child, NavigableString):
                # Collapse whitespace runs but keep their presence, so inline tags don't glue or split words.
                self.parts.append(_SPACES.sub(" ", str(child)))
            elif isinstance(child, Tag):
                if child.name in _HEADINGS:
                    self._heading(child)
                    continue
                block = child.name in _BLOCKS
                if block:
                    self.parts.append("\n")
                self.walk(child)
                if block:
                    self.parts.append("\n")

    def _heading(self, tag: Tag) -> None:
        self._flush()
        name = tag.get_text(" ", strip=True).rstrip("¶").strip()
        level = int(tag.name[1])
        self.path = [(lvl, h) for lvl, h in self.path if lvl < level] + [(level, name)]
        self.parts.append(name + "\n")

    def _flush(self) -> None:
        lines = [" ".join(line.split()) for line in "".join(self.parts).split("\n")]
        text = "\n".join(line for line in lines if line)
        if text:
            self.blocks.append((tuple(h for _, h in self.path), text, None))
        self.parts = []

    def finish(self) -> list[tuple[tuple[str, ...], str, None]]:
        self._flush()
        return self.blocks
