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


ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def _bad(name: str, value: str, expected: str) -> Exception:
    """The error for a knob set to something it cannot mean (a ``MambacOptionsError``, a ValueError)."""
    from mambac.errors import MambacOptionsError
    return MambacOptionsError(f"{name}={value!r}: expected {expected}. Fix or unset the environment variable.")


def _flag_value(name: str, v: str) -> bool:
    v = v.strip().lower()
    if v in ON or v in OFF:
        return v in ON
    raise _bad(name, v, "1 or 0 (also true/false, yes/no, on/off)")


def _flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return default
    return _flag_value(name, v)


def _tristate(name: str, v: str | None) -> str:
    """A knob of auto | 1 | 0 (the flag spellings allowed): "auto", "1" or "0"."""
    v = (v or "").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in ON or v in OFF:
        return "1" if v in ON else "0"
    raise _bad(name, v, "auto, 1 or 0 (also true/false, yes/no, on/off)")


def _walk_choice(v: str | None) -> str:
    """MAMBAC_SSD_WALK: unset, empty or "auto" -> "auto"; otherwise a flag -> "1" or "0"."""
    return _tristate("MAMBAC_SSD_WALK", v)


def _kernels_choice(v: str | None) -> str:
    """MAMBAC_KERNELS: auto (the default) | triton | reference."""
    v = (v or "").strip().lower() or "auto"
    if v not in ("auto", "triton", "reference"):
        raise _bad("MAMBAC_KERNELS", v, "auto, triton or reference")
    return v


def _chunk_choice(v: str | None) -> str:
    """MAMBAC_SSD_CHUNK: unset, empty or "auto" -> "auto"; "model" -> "model"; a whole number of
    steps (at least 16) -> that number as text.  Anything else is an error naming the knob."""
    v = (v or "").strip().lower()
    if v in ("", "auto", "model"):
        return v or "auto"
    if v.isdigit() and int(v) >= 16:
        return str(int(v))
    raise _bad("MAMBAC_SSD_CHUNK", v, "auto, model or a chunk length of at least 16 steps")


def _segments_choice(v: str | None) -> str:
    """MAMBAC_SSD_SEGMENTS: unset, empty or "auto" -> "auto"; a whole number of segments (at least
    1) -> that number as text.  Anything else is an error naming the knob."""
    v = (v or "").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v.isdigit() and int(v) >= 1:
        return str(int(v))
    raise _bad("MAMBAC_SSD_SEGMENTS", v, "auto or a number of segments of at least 1")


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
        kernels=_kernels_choice(os.environ.get("MAMBAC_KERNELS")),
        progress=_tristate("MAMBAC_PROGRESS", os.environ.get("MAMBAC_PROGRESS")),
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
