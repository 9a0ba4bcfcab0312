"""Progress bars for long work (lowering every pass of a program, autotuning kernels), on stderr.

``MAMBAC_PROGRESS``: ``auto`` (default: a bar when stderr is a terminal), ``1`` (always), ``0``
(never).  Bars go through tqdm and vanish when done (``leave=False``), so logs stay clean.
"""
from __future__ import annotations

import sys
from typing import Iterable, TypeVar

from mambac.knobs import knobs

T = TypeVar("T")


def enabled() -> bool:
    mode = knobs().progress
    if mode in ("0", "false", "no", "off"):
        return False
    if mode in ("1", "true", "yes", "on"):
        return True
    return sys.stderr.isatty()


def progress(items: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """``items``, shown as a bar named ``desc`` when progress bars are enabled."""
    if not enabled():
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr, dynamic_ncols=True)
