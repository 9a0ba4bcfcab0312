"""Every environment knob mambac reads, in one place.

The environment is read once, into a frozen ``Knobs`` value; code asks ``knobs()`` for it and never
reads ``os.environ`` itself.  ``override(...)`` replaces values in code (tests, the CLI) and restores
them on exit.  The table of knobs lives in docs/knobs.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator


def _flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


def _walk_choice(v: str | None) -> str:
    """MAMBAC_SSD_WALK: unset, empty or "auto" -> "auto"; otherwise a flag -> "1" or "0"."""
    v = (v or "").strip().lower()
    if v in ("", "auto"):
        return "auto"
    return "0" if v in ("0", "false", "no", "off") else "1"


def _chunk_choice(v: str | None) -> str:
    """MAMBAC_SSD_CHUNK: unset, empty or "auto" -> "auto"; "model" -> "model"; a whole number of
    steps (at least 16) -> that number as text.  Anything else is an error naming the knob."""
    v = (v or "").strip().lower()
    if v in ("", "auto", "model"):
        return v or "auto"
    if v.isdigit() and int(v) >= 16:
        return str(int(v))
    raise ValueError(f"MAMBAC_SSD_CHUNK={v!r}: expected auto, model or a chunk length of at least 16 steps")


def _segments_choice(v: str | None) -> str:
    """MAMBAC_SSD_SEGMENTS: unset, empty or "auto" -> "auto"; a whole number of segments (at least
    1) -> that number as text.  Anything else is an error naming the knob."""
    v = (v or "").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v.isdigit() and int(v) >= 1:
        return str(int(v))
    raise ValueError(f"MAMBAC_SSD_SEGMENTS={v!r}: expected auto or a number of segments of at least 1")


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "mambac")


@dataclass(frozen=True)
class Knobs:
    debug: bool = False            # MAMBAC_DEBUG: extra cross-rank checks, verbose errors
    verify: bool = False           # MAMBAC_VERIFY: run the graph verifier after every pass
    dump_dir: str | None = None    # MAMBAC_DUMP_DIR: write the printed graph after every pass here
    disable_passes: tuple[str, ...] = ()  # MAMBAC_DISABLE_PASSES=a,b: skip these passes by name
    cache_dir: str = ""            # MAMBAC_CACHE_DIR: generated kernels and autotune choices
    logs: str | None = None        # MAMBAC_LOGS: logging level for the "mambac" logger (e.g. info, debug)
    kernels: str = "auto"          # MAMBAC_KERNELS: auto | triton | reference
    progress: str = "auto"         # MAMBAC_PROGRESS: auto (bars on a terminal) | 1 (always) | 0 (never)
    direct_launch: bool = True     # MAMBAC_DIRECT_LAUNCH: repeat launches skip Triton's dispatch (0: never)
    ssd_streams: bool = True       # MAMBAC_SSD_STREAMS: independent SSD launches on a second CUDA stream (0: one stream)
    tma: bool = True               # MAMBAC_TMA: SSD kernels may load tiles through tensor descriptors (0: never)
    ssd_walk: str = "auto"         # MAMBAC_SSD_WALK: auto (where its programs fill the GPU) | 1 (wherever it runs) | 0 (never): SSD states by one walk
    ssd_chunk: str = "auto"        # MAMBAC_SSD_CHUNK: auto (at most 128 steps) | model (the model's chunk_size) | N: the SSD kernels' chunk length
    ssd_segments: str = "auto"     # MAMBAC_SSD_SEGMENTS: auto | N: the SSD forward's state walk and chunk scan in N pipelined segments


def _from_env() -> Knobs:
    disabled = tuple(p.strip() for p in os.environ.get("MAMBAC_DISABLE_PASSES", "").split(",") if p.strip())
    return Knobs(
        debug=_flag("MAMBAC_DEBUG"),
        verify=_flag("MAMBAC_VERIFY"),
        dump_dir=os.environ.get("MAMBAC_DUMP_DIR") or None,
        disable_passes=disabled,
        cache_dir=os.environ.get("MAMBAC_CACHE_DIR") or _default_cache_dir(),
        logs=os.environ.get("MAMBAC_LOGS") or None,
        kernels=(os.environ.get("MAMBAC_KERNELS") or "auto").strip().lower(),
        progress=(os.environ.get("MAMBAC_PROGRESS") or "auto").strip().lower(),
        direct_launch=_flag("MAMBAC_DIRECT_LAUNCH", default=True),
        ssd_streams=_flag("MAMBAC_SSD_STREAMS", default=True),
        tma=_flag("MAMBAC_TMA", default=True),
        ssd_walk=_walk_choice(os.environ.get("MAMBAC_SSD_WALK")),
        ssd_chunk=_chunk_choice(os.environ.get("MAMBAC_SSD_CHUNK")),
        ssd_segments=_segments_choice(os.environ.get("MAMBAC_SSD_SEGMENTS")),
    )


_current: Knobs | None = None


def knobs() -> Knobs:
    """The knobs in force (read from the environment on first use)."""
    global _current
    if _current is None:
        _current = _from_env()
    return _current


def reload() -> Knobs:
    """Re-read the environment (tests that set variables call this)."""
    global _current
    _current = _from_env()
    return _current


@contextlib.contextmanager
def override(**values) -> Iterator[Knobs]:
    """Temporarily replace some knobs in code: ``with override(verify=True): ...``."""
    global _current
    old = knobs()
    _current = dataclasses.replace(old, **values)
    try:
        yield _current
    finally:
        _current = old
