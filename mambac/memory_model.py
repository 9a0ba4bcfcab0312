"""The memory model of one lowered graph: its saved-for-backward storages (``memory_record``),
node costs (``memory_costs``) and, on request, formulas in B and L (``memory_formulas``); what is
kept and what it costs when some regions are recomputed.  Part of ``mambac.memory``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import sympy
import torch
import torch.fx

from mambac.ir import SOURCE
from mambac.memory_costs import Machine, NodeCost, op_name
from mambac.memory_formulas import fit_formulas
from mambac.memory_record import Storage, _Run, autocast_state, example_dims, run_saved, snapshot

MEMORY_PLAN = "mambac_memory"   # gm.meta: the RematPlan that plan_remat chose (with its MemoryModel)


@dataclass
class MemoryModel:
    """Saved-for-backward storages and node costs of one graph at its example shape."""

    example: tuple[int, int]
    run: _Run
    order: tuple[str, ...]
    ops: dict[str, str]
    modules: dict[str, str]
    autocast: tuple[str, torch.dtype | None] = ("cpu", None)
    machine: Machine = field(default_factory=Machine)
    graph: torch.fx.GraphModule | None = None   # an unplanned copy, for fitting formulas
    _formulas: dict[str, sympy.Expr | None] | None = None

    @property
    def storages(self) -> dict[str, Storage]:
        return self.run.storages

    def kept(self, regions: Sequence[Any] = ()) -> list[Storage]:
        """Storages alive between forward and backward when ``regions`` (each with the names of
        its ``nodes`` and ``inputs``, e.g. a ``RegionSpec``) are recomputed: those some node outside
        every region saves, plus the storages of every region's inputs (the checkpoint keeps them)."""
        inside = {n for r in regions for n in r.nodes}
        pinned = {k for r in regions for i in r.inputs for k in self.run.values.get(i, ())}
        return [s for s in self.run.storages.values()
                if s.key in pinned or any(v not in inside for v in s.savers)]

    def predict(self, regions: Sequence[Any] = ()) -> int:
        """Saved-for-backward bytes at the example shape with ``regions`` recomputed."""
        return sum(s.nbytes for s in self.kept(regions))

    def cost(self, nodes: Iterable[str]) -> float:
        """Seconds to recompute ``nodes`` once (roofline of each node's FLOPs and bytes)."""
        zero = NodeCost(0, 0)
        return sum(self.machine.seconds(c.flops, c.io_bytes) for c in (self.run.costs.get(n, zero) for n in nodes))

    def flops(self, nodes: Iterable[str]) -> int:
        return sum(self.run.costs[n].flops for n in nodes if n in self.run.costs)

    # ---- formulas -----------------------------------------------------------------------

    def formula(self, key: str) -> sympy.Expr | None:
        """Bytes of storage ``key`` (or ``flops:<node>``) as a polynomial in B and L, if bilinear."""
        if self._formulas is None:
            self._formulas = fit_formulas(self)
        return self._formulas.get(key)

    def total_formula(self, storages: Iterable[Storage]) -> sympy.Expr | None:
        terms = [self.formula(s.key) for s in storages]
        return None if any(t is None for t in terms) else sympy.factor(sympy.Add(*terms))


def analyse(gm: torch.fx.GraphModule, machine: Machine | None = None) -> MemoryModel:
    """The memory model of ``gm`` (an unplanned lowered graph with shapes) at its example shape."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return MemoryModel(
        example=example_dims(gm) or (0, 0), run=run_saved(gm),
        order=tuple(n.name for n in nodes), ops={n.name: op_name(n) for n in nodes},
        modules={n.name: getattr(n.meta.get(SOURCE), "module_path", "") for n in nodes},
        autocast=autocast_state(gm), machine=machine or Machine(), graph=snapshot(gm))
