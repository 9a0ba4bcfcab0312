"""An indented source writer: the one way codegen builds Python/Triton text.

Renderers call ``line`` for statements and ``block`` for anything that opens a suite (``def``,
``for``, ``if``); the writer owns indentation so renderer code reads like the code it emits.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

INDENT = "    "


class Writer:
    """Accumulates lines of source at the current indentation level."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._level = 0

    def line(self, text: str = "") -> None:
        """Emit one statement (an empty string emits a blank line)."""
        self._lines.append(INDENT * self._level + text if text else "")

    def lines(self, *texts: str) -> None:
        """Emit several statements at the current level."""
        for t in texts:
            self.line(t)

    def comment(self, text: str) -> None:
        self.line("# " + text)

    @contextlib.contextmanager
    def block(self, header: str) -> Iterator[None]:
        """Emit ``header`` (which must end with ':') and indent what is written inside."""
        if not header.rstrip().endswith(":"):
            raise ValueError(f"a block header must end with ':', got {header!r}")
        self.line(header)
        self._level += 1
        try:
            yield
        finally:
            self._level -= 1

    @contextlib.contextmanager
    def indented(self) -> Iterator[None]:
        """Indent without a header (continuation lines of a long call)."""
        self._level += 1
        try:
            yield
        finally:
            self._level -= 1

    def source(self) -> str:
        """The text written so far, ending with one newline."""
        return "\n".join(self._lines).rstrip() + "\n"
