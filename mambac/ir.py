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
PLAN = "mambac_plan"            # gm.meta: the RankPlan a per-rank program is lowered for
GLOBAL_SHAPES = "mambac_global_shapes"  # gm.meta: node name -> shape in the unsharded model's graph
CP_LENGTH = "mambac_cp_length"  # gm.meta: the whole sequence length a cp rank's program is lowered for
MESH = "mambac_mesh"            # gm.meta: the MeshSpec (sizes, this rank, group names)
KERNELS = "mambac_kernels"      # gm.meta: the kernel mode the program runs under (fake runs use it too)
WANTS = "mambac_wants"          # dict input-name -> Placement an op needs its input in (set by propagate_sharding)


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
class Segment:
    """One run of a sharded dimension, in local order: this rank holds ``size`` entries starting at
    ``start`` of a logical block of ``total`` entries named ``name`` (e.g. the heads' x in in_proj).
    A segment whose ``size`` equals ``total`` is held whole by every rank (replicated)."""

    name: str
    start: int
    size: int
    total: int

    @property
    def replicated(self) -> bool:
        return self.size == self.total

    def __str__(self) -> str:
        return f"{self.name}:{self.size}r" if self.replicated else f"{self.name}:{self.start}+{self.size}/{self.total}"


@dataclass(frozen=True)
class Replicate:
    """Every rank of the mesh dimension holds the whole value."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a term; the value is the sum over the mesh dimension."""

    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    """Each rank holds a slice along tensor dim ``dim`` (non-negative).  ``segments`` lists, in local
    order, which part of which logical block the slice holds; empty means one block split evenly
    (first ranks take one more) whose size may only be known at run time (batch, sequence)."""

    dim: int
    segments: tuple[Segment, ...] = ()

    def __str__(self) -> str:
        if not self.segments:
            return f"S({self.dim})"
        return f"S({self.dim})[" + "|".join(str(s) for s in self.segments) + "]"

    def moved(self, dim: int, segments: tuple[Segment, ...] | None = None) -> "Shard":
        return Shard(dim, self.segments if segments is None else segments)


R = Replicate()
P = Partial()
MeshPlacement = Replicate | Partial | Shard


@dataclass(frozen=True)
class Placement:
    """DTensor-style placement of a value over the mesh: one entry per mesh dimension (in the
    order of ``mesh_dims``, e.g. ``("dp", "tp")``), each Replicate, Partial or Shard."""

    per_mesh_dim: tuple[MeshPlacement, ...] = (R,)
    mesh_dims: tuple[str, ...] = ("tp",)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{n}={p}" for n, p in zip(self.mesh_dims, self.per_mesh_dim)) + "]"

    def on(self, mesh_dim: str) -> MeshPlacement:
        return self.per_mesh_dim[self.mesh_dims.index(mesh_dim)]

    def with_(self, mesh_dim: str, p: MeshPlacement) -> "Placement":
        i = self.mesh_dims.index(mesh_dim)
        return Placement(self.per_mesh_dim[:i] + (p,) + self.per_mesh_dim[i + 1:], self.mesh_dims)

    @property
    def replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.per_mesh_dim)


@dataclass(frozen=True)
class Placements:
    """Placements of a node that returns several tensors (a split, an op with several outputs)."""

    items: tuple[Placement | None, ...]

    def __str__(self) -> str:
        return "(" + ", ".join(str(p) for p in self.items) + ")"


@dataclass(frozen=True)
class MeshSpec:
    """The device mesh one program is lowered for: dp x cp x tp ranks, this rank's coordinates,
    the process-group names its collectives use (placeholders when lowering without process
    groups), and the layout options.  ``dims`` are the mesh dims that placements speak of; the
    context-parallel split of the sequence (``cp``) is not a placement: the program is lowered for
    this rank's piece of the sequence and ``split_sequence`` makes the sequence ops exchange state."""

    dp: int = 1
    tp: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    dp_group: str = "dp"
    tp_group: str = "tp"
    sequence_parallel: bool = False
    output: str = "full"
    dims: tuple[str, ...] = ("dp", "tp")
    cp: int = 1
    cp_rank: int = 0
    cp_group: str = "cp"

    def size(self, dim: str) -> int:
        return self.dp if dim == "dp" else self.tp

    def rank(self, dim: str) -> int:
        return self.dp_rank if dim == "dp" else self.tp_rank

    def group(self, dim: str) -> str:
        return self.dp_group if dim == "dp" else self.tp_group

    def replicated(self) -> Placement:
        return Placement((R,) * len(self.dims), self.dims)


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
