"""Reports of the memory model: the per-node table (``memory_table``) and the printable report
(``explain_memory``: saved bytes without remat and under the plan, with formulas, the budget, the
regions and the largest saved activations).  Part of ``mambac.memory``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx

from mambac.memory_model import MEMORY_PLAN
from mambac.memory_record import Storage


@dataclass(frozen=True)
class NodeRow:
    """One row of ``memory_table``: a node's saved bytes, cost and remat decision."""

    name: str
    op: str
    module: str
    out_bytes: int
    saved_bytes: int
    kept_bytes: int
    saved_formula: sympy.Expr | None
    flops: int
    flops_formula: sympy.Expr | None
    region: str | None


def human(nbytes: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _programs(obj: Any) -> list[torch.fx.GraphModule]:
    if isinstance(obj, torch.fx.GraphModule):
        return [obj]
    if hasattr(obj, "gm"):
        return [obj.gm]
    programs = getattr(obj, "programs", None)
    if programs is None:
        raise TypeError(f"explain_memory takes a compiled module, a lowered program or a GraphModule, "
                        f"got {type(obj).__name__}")
    if not programs:
        raise RuntimeError("nothing lowered yet: call the module (or mambac.compile with example_inputs) first")
    return [p.gm for p in programs.values()]


def plan_of(gm: torch.fx.GraphModule):
    """The RematPlan plan_remat left on ``gm``, or a no-remat plan computed now (under the autocast
    in force now) and kept there."""
    if MEMORY_PLAN not in gm.meta:
        from mambac.passes.plan_remat import make_plan
        gm.meta[MEMORY_PLAN] = make_plan(gm, "none", None)
    return gm.meta[MEMORY_PLAN]


def memory_table(obj: Any) -> list[NodeRow]:
    """Per-node rows of the (first) program: saved bytes without remat and kept under its plan,
    the formula of the saved bytes, FLOPs and their formula, the region recomputing the node."""
    plan = plan_of(_programs(obj)[0])
    model = plan.model
    region_of = {n: r.name for r in plan.regions for n in r.nodes}
    kept = {s.key for s in model.kept(plan.regions)}
    made: dict[str, list[Storage]] = {}
    for s in model.storages.values():
        made.setdefault(s.producer, []).append(s)
    rows = []
    for name in model.order:
        mine = made.get(name, [])
        saved = [s for s in mine if s.savers]
        rows.append(NodeRow(
            name=name, op=model.ops[name], module=model.modules[name],
            out_bytes=sum(s.nbytes for s in mine if not s.internal), saved_bytes=sum(s.nbytes for s in saved),
            kept_bytes=sum(s.nbytes for s in mine if s.key in kept), saved_formula=model.total_formula(saved),
            flops=model.flops([name]), flops_formula=model.formula(f"flops:{name}"), region=region_of.get(name)))
    return rows


def explain_memory(obj: Any, top: int = 12) -> str:
    """A printable report per program: saved-for-backward bytes without remat and with the plan
    (with their formulas in B and L), the budget, what each region recomputes and frees, and the
    nodes whose outputs weigh most."""
    return "\n\n".join(_summary(gm) + _regions(gm) + _largest(gm, top) for gm in _programs(obj))


def _summary(gm: torch.fx.GraphModule) -> str:
    plan = plan_of(gm)
    model = plan.model
    dev, dtype = model.autocast
    lines = [f"mambac memory report: remat='{plan.mode}', example B={model.example[0]}, L={model.example[1]}"
             + (f", {dev} autocast {str(dtype).replace('torch.', '')}" if dtype is not None else ""),
             "saved for backward (activations; parameters and inputs excluded):",
             f"  without remat : {human(plan.baseline):>11}   = {model.total_formula(model.kept())}",
             f"  with this plan: {human(plan.predicted):>11}   = {model.total_formula(model.kept(plan.regions))}"]
    if plan.budget is not None:
        if plan.fixed:
            lines.append(f"  memory_budget : {human(plan.budget + plan.fixed):>11}   (scope 'step': "
                         f"{human(plan.fixed)} for parameters, gradients, AdamW's moments and the loss's workspace)")
        lines.append(f"  budget        : {human(plan.budget):>11}   ({'met' if plan.predicted <= plan.budget else 'NOT met'}"
                     f"; the least reachable is {human(plan.minimum or 0)})")
    return "\n".join(lines) + "\n"


def _regions(gm: torch.fx.GraphModule) -> str:
    plan = plan_of(gm)
    model = plan.model
    fwd, extra = model.flops(model.order), model.flops(n for r in plan.regions for n in r.nodes)
    lines = [f"recomputed in backward: {len(plan.regions)} regions, {sum(len(r.nodes) for r in plan.regions)} nodes, "
             f"{extra / 1e9:.3g} GFLOP ({100 * extra / max(fwd, 1):.1f}% of the forward's {fwd / 1e9:.3g} GFLOP)"]
    base = model.kept()
    for r in plan.regions:
        still = {k.key for k in model.kept([r])}
        freed = sum(s.nbytes for s in base if s.key not in still)
        ops = dict.fromkeys(model.ops[n] for n in r.nodes if model.run.costs[n].io_bytes)
        lines.append(f"  {r.name} ({r.kind}, {len(r.nodes)} nodes, frees {human(freed)}, "
                     f"{model.flops(r.nodes) / 1e9:.3g} GFLOP): " + ", ".join(ops))
    return "\n".join(lines) + "\n"


def _largest(gm: torch.fx.GraphModule, top: int) -> str:
    rows = [r for r in sorted(memory_table(gm), key=lambda r: -r.saved_bytes)[:top] if r.saved_bytes]
    lines = ["largest saved activations (node | op | module | saved | kept | formula | flops):"]
    lines += [f"  {r.name} | {r.op} | {r.module or '-'} | {human(r.saved_bytes)} | {human(r.kept_bytes)} | "
              f"{r.saved_formula} | {r.flops_formula if r.flops_formula is not None else r.flops}" for r in rows]
    return "\n".join(lines)
