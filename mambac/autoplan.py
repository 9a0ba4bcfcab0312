"""The automatic layout planner: which (tp, cp, dp, sequence_parallel, remat) to use for a model on
W devices with a given memory per device, batch and sequence length.

Every candidate layout gets a predicted step time (compute, recompute and communication) and a
predicted memory per rank (weights, gradients, optimizer state and saved activations); the
feasible ones are ranked fastest first.  Activation bytes and FLOPs come from the memory model
(``mambac.memory``: what autograd saves, as formulas in B and L, and each node's FLOPs), measured
once on the single-device program at a small example shape; the layouts only rescale them.
docs/planner.md explains the model and its assumptions.  This module predicts only: it lowers
nothing for several ranks; ``mambac.compile(..., plan="auto")`` (``mambac.plan_auto``) compiles
with the best row that compile can run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from mambac.errors import MambacInputError, MambacOptionsError
from mambac.memory import human
from mambac.model_cost import ActBytes, ModelCost, measure
from mambac.sizes import parse_bytes

REMAT_MODES = ("none", "auto", "full")


@dataclass(frozen=True)
class Device:
    """One accelerator and its links.  Defaults: one H200 of an 8-GPU NVLink node (dense bf16
    peak, HBM3e bandwidth, NVLink bandwidth per direction, a typical small-message collective
    latency); ``efficiency`` is the fraction of peak FLOP/s a training step reaches."""

    name: str = "H200"
    flops_per_s: float = 989e12
    memory_bytes_per_s: float = 4.8e12
    link_bytes_per_s: float = 450e9
    latency_s: float = 10e-6
    memory: int = 141 * 10**9
    efficiency: float = 0.5

    def compute_seconds(self, flops: float, nbytes: float) -> float:
        """Roofline time of ``flops`` FLOPs that move ``nbytes`` bytes."""
        return max(flops / (self.flops_per_s * self.efficiency), nbytes / self.memory_bytes_per_s)


H200 = Device()
CPU = Device(name="CPU", flops_per_s=2e12, memory_bytes_per_s=200e9, link_bytes_per_s=20e9,
             latency_s=50e-6, memory=256 * 2**30, efficiency=0.3)
DEVICES = {"h200": H200, "cpu": CPU}


@dataclass(frozen=True)
class Layout:
    """One way to run a step on ``tp * cp * dp`` ranks."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    remat: str = "none"

    def __str__(self) -> str:
        return (f"tp={self.tp} cp={self.cp} dp={self.dp} sp={'on' if self.sequence_parallel else 'off'} "
                f"remat={self.remat}")


@dataclass(frozen=True)
class Row:
    """One ranked candidate: its predicted step time and memory per rank (with the parts), whether
    it fits and, when it does not or cannot run, why."""

    layout: Layout
    step_s: float
    memory: float
    feasible: bool
    reason: str
    compute_s: float = 0.0
    comm_s: float = 0.0
    weights: float = 0.0
    activations: float = 0.0
    memory_budget: int | None = None   # remat='auto': the saved-activation bytes per rank it may keep


# ---------------------------------------------------------------------------------------------
# the cost model of one layout
# ---------------------------------------------------------------------------------------------

def _ring(n: int, nbytes: float, dev: Device, factor: float) -> float:
    """A ring collective over ``n`` ranks moving ``factor * (n-1)/n * nbytes`` per rank
    (all-reduce: factor 2; all-gather, reduce-scatter: 1), plus one latency per step."""
    if n <= 1:
        return 0.0
    steps = factor * (n - 1)
    return steps * dev.latency_s + factor * (n - 1) / n * nbytes / dev.link_bytes_per_s


def comm_seconds(cost: ModelCost, lay: Layout, b: float, l: float, dev: Device) -> float:
    """Communication per step, nothing overlapped with compute (a conservative bound)."""
    t = 0.0
    act = b * l * cost.d_model * cost.act_elem_bytes      # one (b, l, d_model) activation
    colls = 2 * (2 * cost.n_layer + 2)    # per block and for embedding and head: forward + backward
    if lay.sequence_parallel:
        t += colls * (_ring(lay.tp, act, dev, 1) + _ring(lay.tp, act, dev, 1))
    else:
        t += colls * _ring(lay.tp, act, dev, 2)
    if lay.cp > 1:   # per layer, forward and backward: states and halos along a chain of cp ranks
        hop = b * (cost.state_bytes + cost.halo_bytes) / lay.tp
        t += 2 * cost.n_layer * (lay.cp - 1) * (dev.latency_s + hop / dev.link_bytes_per_s)
    grads = cost.params * cost.param_bytes / lay.tp
    return t + _ring(lay.dp * lay.cp, grads, dev, 2)


def _recompute_io(cost: ModelCost, remat: str) -> float:
    if cost.recompute_io_bytes_per_token is not None:
        return cost.recompute_io_bytes_per_token[remat]
    share = cost.recompute_flops_per_token[remat] / max(cost.flops_per_token, 1.0)
    return share * cost.io_bytes_per_token


def _auto(cost: ModelCost, lay: Layout, b: float, l: float, room: float) -> tuple[float, float, str]:
    """remat='auto' keeping at most ``room`` activation bytes per rank: the activations it keeps, the
    share of full remat's recompute it is charged (the bytes it must free over the bytes full remat
    frees: an upper bound, as 'auto' recomputes the cheapest bytes first), and why it does not
    apply, if it does not."""
    none = cost.act["none"].per_rank(b, l, lay.tp, lay.sequence_parallel)
    full = cost.act["full"].per_rank(b, l, lay.tp, lay.sequence_parallel)
    if none <= room:
        return none, 0.0, "remat='none' fits: nothing to recompute"
    if full > room:
        return full, 1.0, "does not fit even with every block recomputed"
    return room, (none - room) / max(none - full, 1.0), ""


def evaluate(cost: ModelCost, lay: Layout, batch: int, seqlen: int, dev: Device, memory_limit: float) -> Row:
    """Predicted step time and memory per rank of ``lay`` (see docs/planner.md)."""
    b, l = batch / lay.dp, seqlen / lay.cp
    weights = cost.params * (2 * cost.param_bytes + cost.optimizer_bytes) / lay.tp
    budget, why = None, ""
    if lay.remat == "auto":   # keep what the device has room for, recompute the rest
        budget = int(memory_limit - weights)
        acts, share, why = _auto(cost, lay, b, l, budget)
        recompute_flops, recompute_io = (share * cost.recompute_flops_per_token["full"],
                                         share * _recompute_io(cost, "full"))
    else:
        acts = cost.act[lay.remat].per_rank(b, l, lay.tp, lay.sequence_parallel)
        recompute_flops, recompute_io = cost.recompute_flops_per_token[lay.remat], _recompute_io(cost, lay.remat)
    tokens = b * l
    flops = tokens * (3 * cost.flops_per_token + recompute_flops) / lay.tp
    compute = dev.compute_seconds(flops, tokens * (3 * cost.io_bytes_per_token + recompute_io) / lay.tp)
    comm = comm_seconds(cost, lay, b, l, dev)
    memory = weights + acts
    reason = "" if memory <= memory_limit else f"needs {human(memory)} > {human(memory_limit)} per rank"
    reason = reason or why
    return Row(lay, compute + comm, memory, not reason, reason, compute, comm, weights, acts, budget)


def _why_not(cost: ModelCost, lay: Layout, batch: int, seqlen: int) -> str:
    if batch % lay.dp:
        return f"batch {batch} not divisible by dp={lay.dp}"
    if seqlen % lay.cp:
        return f"seqlen {seqlen} not divisible by cp={lay.cp}"
    if lay.tp > cost.max_tp:
        return f"tp={lay.tp} exceeds the {cost.max_tp} heads"
    if lay.sequence_parallel and seqlen % (lay.tp * lay.cp):
        return f"seqlen {seqlen} not divisible by tp*cp={lay.tp * lay.cp} (sequence parallel)"
    return ""


def candidates(world_size: int) -> list[Layout]:
    """Every (tp, cp, dp) with tp*cp*dp = world_size, with and without sp (tp > 1), each remat mode
    (none, auto: recompute only what does not fit, full: every block)."""
    out = []
    for tp in (d for d in range(1, world_size + 1) if world_size % d == 0):
        rest = world_size // tp
        for cp in (d for d in range(1, rest + 1) if rest % d == 0):
            for sp in ((False, True) if tp > 1 else (False,)):
                out += [Layout(tp, cp, rest // cp, sp, r) for r in REMAT_MODES]
    return out


def rank_layouts(cost: ModelCost, world_size: int, device_memory: float, batch: int, seqlen: int,
                 device: Device = H200) -> list[Row]:
    """Every candidate, feasible ones first, each group fastest first (then smallest)."""
    if world_size < 1 or batch < 1 or seqlen < 1 or device_memory <= 0:
        raise MambacInputError("world_size, batch, seqlen and device_memory must be positive.")
    rows = []
    for lay in candidates(world_size):
        why = _why_not(cost, lay, batch, seqlen)
        if why:
            rows.append(Row(lay, math.inf, math.inf, False, why))
        else:
            rows.append(evaluate(cost, lay, batch, seqlen, device, device_memory))
    return sorted(rows, key=lambda r: (not r.feasible, r.step_s, r.memory))


def plan(model: torch.nn.Module | ModelCost, world_size: int = 1, device_memory: float | str | None = None,
         batch: int = 1, seqlen: int = 2048, device: Device | str = "h200",
         example: tuple[int, int] = (2, 32)) -> list[Row]:
    """Rank the layouts of ``model`` (an nn.Module, measured with the memory model at ``example``,
    or a ``ModelCost``) on ``world_size`` devices of ``device_memory`` bytes (default: the
    device's) for a step of ``batch`` sequences of ``seqlen`` tokens; best first.  Raises a
    ``MambacOptionsError`` naming the smallest memory any layout needs when none fits."""
    dev = DEVICES[device.lower()] if isinstance(device, str) else device
    limit = dev.memory if device_memory is None else parse_bytes(device_memory)
    cost = model if isinstance(model, ModelCost) else ModelCost.from_module(model, example)
    rows = rank_layouts(cost, world_size, limit, batch, seqlen, dev)
    if not rows[0].feasible:
        runnable = [r for r in rows if math.isfinite(r.memory)]
        if not runnable:
            raise MambacOptionsError(f"no layout of {world_size} ranks can run batch {batch} x seqlen {seqlen}: "
                                     + "; ".join(sorted({r.reason for r in rows})))
        best = min(runnable, key=lambda r: r.memory)
        raise MambacOptionsError(
            f"no layout fits {human(limit)} per device on {world_size} ranks for batch {batch} x seqlen {seqlen}; "
            f"the smallest is {best.layout} at {human(best.memory)} per rank "
            f"({human(best.weights)} weights, gradients and optimizer state, {human(best.activations)} activations). "
            "Give more memory or more ranks, or a smaller batch or sequence.")
    return rows


def format_table(rows: Sequence[Row], limit: int | None = 10) -> str:
    """The rows as a printable table (the first ``limit`` feasible ones; all when None)."""
    shown = [r for r in rows if r.feasible][:limit] if limit is not None else list(rows)
    head = f"{'#':>3}  {'tp':>3} {'cp':>3} {'dp':>3} {'sp':>3} {'remat':>5}  {'step':>10} {'compute':>10} " \
           f"{'comm':>10}  {'memory/rank':>12}  note"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(shown, 1):
        lay = r.layout
        times = (f"{_ms(r.step_s)} {_ms(r.compute_s)} {_ms(r.comm_s)}" if math.isfinite(r.step_s)
                 else f"{'-':>10} {'-':>10} {'-':>10}")
        mem = human(r.memory) if math.isfinite(r.memory) else "-"
        lines.append(f"{i:>3}  {lay.tp:>3} {lay.cp:>3} {lay.dp:>3} {'on' if lay.sequence_parallel else 'off':>3} "
                     f"{lay.remat:>5}  {times}  {mem:>12}  {r.reason or _fits(r)}")
    return "\n".join(lines)


def _fits(row: Row) -> str:
    return "fits" if row.memory_budget is None else f"fits, memory_budget={human(row.memory_budget)}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:>8.3f}ms"


def with_device(device: Device, **changes: float) -> Device:
    """A copy of ``device`` with some parameters changed (e.g. ``link_bytes_per_s``)."""
    return replace(device, **changes)


__all__ = ["CPU", "H200", "ActBytes", "Device", "Layout", "ModelCost", "Row", "candidates", "evaluate",
           "format_table", "parse_bytes", "plan", "rank_layouts", "measure", "with_device"]
