"""The context every pass receives: configuration in, statistics and history out."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mambac.ir import GraphStats


@dataclass
class PassContext:
    """Configuration for one lowering (one rank's program) and what the passes report back.

    ``options`` is the validated ``CompileOptions``; ``rank``/``world_size`` name the program being
    lowered; ``verify``/``dump_dir``/``disabled`` come from the knobs (or code).  Passes write
    counters into ``stats[pass_name]``; the runner keeps each pass's printed graph in ``history``
    (and its Graphviz source in ``dot_history``, for ``mambac dump --format dot|svg``) and its wall
    time in ``timings``.
    """

    options: Any = None
    rank: int = 0
    world_size: int = 1
    verify: bool = True
    dump_dir: str | None = None
    disabled: tuple[str, ...] = ()
    stats: dict[str, GraphStats] = field(default_factory=dict)
    history: list[tuple[str, str]] = field(default_factory=list)
    dot_history: list[tuple[str, str]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def stats_for(self, pass_name: str) -> GraphStats:
        return self.stats.setdefault(pass_name, GraphStats())

    def count(self, pass_name: str, key: str) -> int:
        return self.stats.get(pass_name, GraphStats()).counts.get(key, 0)
