"""Small helpers the extractors share: archive members as (name, bytes) pairs, decoding and tidying text."""

from __future__ import annotations

import re
from collections.abc import Iterable

Members = Iterable[tuple[str, bytes]]


def text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def tidy(s: str) -> str:
    """Strip trailing spaces, collapse runs of blank lines, trim the ends."""
    s = re.sub(r"[ \t]+\n", "\n", s.replace("\r\n", "\n"))
    return re.sub(r"\n{3,}", "\n\n", s).strip()
