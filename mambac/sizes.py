"""Sizes in bytes as people write them: 8 * 2**30, 8e9, "8GiB", "141 GB", "512MiB".

One reader for every door (``mambac.compile``'s ``memory_budget`` and ``device_memory``, the
planner, the CLI's ``--memory-budget`` and ``--device-memory``), so a size that one accepts the
others accept too.
"""
from __future__ import annotations

import math
import re

from mambac.errors import MambacInputError

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """Whole bytes from a number or a string with an optional unit (decimal kB..TB or binary
    KiB..TiB, any case, spaces allowed); a fraction of a byte is dropped."""
    if isinstance(value, bool):
        raise MambacInputError(f"cannot read {value!r} as a size: write e.g. 8GiB, 141GB or 8e9.")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if m is None or m.group(2).lower() not in UNITS:
            raise MambacInputError(f"cannot read {value!r} as a size: write e.g. 8GiB, 141GB or 8e9.")
        number = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not math.isfinite(number):
        raise MambacInputError(f"cannot read {value!r} as a size: it is not a finite number of bytes.")
    return int(number)
