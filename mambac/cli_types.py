"""argparse types shared by the ``mambac`` commands (and ``mambac demo``): a bad count, rank,
duration or rate stops at the parser with the option's name, before any model loads."""
from __future__ import annotations

import argparse
from typing import Any, Callable


def checked(convert: Callable[[str], Any], what: str, ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    """An argparse type: ``convert`` the text (else "expected ``what``"), then require ``ok``
    (else ``rule``), so that a bad count or rank stops at the parser with the option's name."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value
    return parse


count = checked(int, "a positive integer", lambda v: v >= 1, "must be a positive integer")   # ranks, batch, length
index = checked(int, "a non-negative integer", lambda v: v >= 0, "must not be negative")     # a rank, restarts
seconds = checked(float, "a number of seconds", lambda v: v > 0, "must be a positive number of seconds")
rate = checked(float, "a number", lambda v: v > 0, "must be a positive number")   # a learning rate
