"""Tiny corpora written by the tests themselves (no data files checked in)."""

from __future__ import annotations

import json
from pathlib import Path

MARKDOWN = """# Lighthouses

Lighthouses guide ships at night.

## Lenses

The Fresnel lens concentrates light into a beam visible for twenty nautical miles.

## Keepers

Keepers trimmed the wicks every four hours.
"""

HTML = """<html><head><title>Tide Tables</title><style>.x{color:red}</style>
<script>var secret = "SCRIPT_NOISE";</script></head>
<body><nav><a href="/">NAV_NOISE home</a></nav>
<main><h1>Tide Tables</h1><p>Spring tides occur near the <b>new</b> and full moon.</p>
<h2>Neap tides</h2><p>Neap tides have the smallest range.</p></main>
<footer>FOOTER_NOISE</footer></body></html>"""

RECORDS = [
    {"passage_id": "Otters#0", "title": "Otters", "text": "Sea otters use stones to open shellfish."},
    {"passage_id": "Otters#1", "title": "Otters", "text": "Otters have the densest fur of any animal."},
    {"passage_id": "Bees#0", "title": "Bees", "text": "Honey bees communicate with a waggle dance."},
]


def write_pdf(path: Path, pages: list[str], password: str | None = None) -> None:
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfgen import canvas

    pdf = canvas.Canvas(str(path), pagesize=A4, encrypt=password)
    for text in pages:
        pdf.drawString(72, 760, text)
        pdf.showPage()
    pdf.save()


def write_corpus(root: Path) -> Path:
    (root / "guide").mkdir(parents=True, exist_ok=True)
    (root / "guide" / "lighthouses.md").write_text(MARKDOWN)
    (root / "tides.html").write_text(HTML)
    (root / "notes.txt").write_text("Barnacles glue themselves to rocks for life.\n")
    write_pdf(root / "manual.pdf", ["Page one speaks of anchors.", "Page two speaks of sails."])
    (root / "animals.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")  # unknown extension: skipped and counted
    return root
