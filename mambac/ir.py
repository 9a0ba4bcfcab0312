"""The IR's annotations: small frozen dataclasses stored in ``node.meta`` under named keys.

The IR itself is a ``torch.fx.GraphModule``; SSM primitives are single ``call_function`` nodes
(``torch.ops.mambac.*``).  Shapes come from fake-tensor propagation in ``node.meta["val"]``.
Passes add annotations under the keys below, never positional tuples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx

VAL = "val"                # FakeTensor (or tuple of them) from shape propagation
SOURCE = "mambac_source"   # SourceInfo: which module and pass a node comes from
FUSION = "mambac_fusion"   # FusionInfo: what a fused op absorbed
PLACEMENT = "mambac_placement"  # Placement: how a value is laid out across ranks


@dataclass(frozen=True)
class SourceInfo:
    """Where a node came from: the module path that produced it and the pass that last wrote it."""

    module_path: str = ""
    module_type: str = ""
    created_by: str = "capture"


@dataclass(frozen=True)
class FusionInfo:
    """What a fused op absorbed: the names of the fusions applied, in order (e.g. 'dt_prologue')."""

    fusions: tuple[str, ...] = ()

    def plus(self, name: str) -> "FusionInfo":
        return FusionInfo(self.fusions + (name,))


@dataclass(frozen=True)
class Placement:
    """DTensor-style placement of a value over the mesh: one entry per mesh dimension, each
    ``"R"`` (replicate), ``"S(d)"`` (shard along tensor dim d) or ``"P"`` (partial sum)."""

    per_mesh_dim: tuple[str, ...] = ("R",)

    def __str__(self) -> str:
        return "[" + ", ".join(self.per_mesh_dim) + "]"


@dataclass
class GraphStats:
    """Counters a pass reports (fusion matches, removed nodes, ...): name → count."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n


def source_of(node: torch.fx.Node) -> SourceInfo:
    return node.meta.get(SOURCE, SourceInfo())


def fusion_of(node: torch.fx.Node) -> FusionInfo:
    return node.meta.get(FUSION, FusionInfo())
