"""On-disk cache of generated kernels and autotune choices.

Layout under ``knobs().cache_dir`` (MAMBAC_CACHE_DIR)::

    kernels/<name>-<hash>/kernel.py     generated source, keyed by the hash of its text
    kernels/<name>-<hash>/repro.py      written when a stage fails, runnable on its own
    autotune/<family>.json              {"<shape bucket>|<device>": <TileConfig json>}

Every write goes to a temporary file first and is renamed into place, so concurrent processes
(several ranks compiling the same kernel) never read a half-written file.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from mambac.knobs import knobs


def content_hash(text: str) -> str:
    """Stable short hash of a text (the cache key of a generated kernel)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_root() -> Path:
    return Path(knobs().cache_dir)


def kernel_dir(name: str, source: str) -> Path:
    """Where the artefacts of kernel ``name`` with this exact source live."""
    return cache_root() / "kernels" / f"{name}-{content_hash(source)}"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_source(name: str, source: str) -> Path:
    """Store a generated kernel (once per distinct text) and return its file."""
    path = kernel_dir(name, source) / "kernel.py"
    if not path.exists() or path.read_text() != source:
        write_atomic(path, source)
    return path


def autotune_file(family: str) -> Path:
    return cache_root() / "autotune" / f"{family}.json"


def load_choices(family: str) -> dict[str, str]:
    """All persisted autotune choices of one kernel family ({} when none or unreadable)."""
    path = autotune_file(family)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_choice(family: str, key: str, value: str) -> None:
    """Persist one autotune choice, merging with what other processes wrote meanwhile."""
    data = load_choices(family)
    data[key] = value
    write_atomic(autotune_file(family), json.dumps(data, indent=1, sort_keys=True))
