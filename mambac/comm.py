"""Communication per layer: every collective a mixer's forward and backward run, as a formula.

``layer_comm(mixer, tp=..., cp=..., sequence_parallel=...)`` lists the collectives one Mamba-1,
Mamba-2 or Mamba-3 mixer runs under the Megatron tensor-parallel layout (``mambac.sharding_plan``) and
under context parallelism (``mambac.runtime.context_parallel``), each with its payload in bytes as
a sympy expression of the symbols ``BATCH`` and ``SEQLEN`` (the full, unsplit sequence length).

The payload is the size of the collective's whole logical tensor: the tensor summed by an
all-reduce, the gathered result of an all-gather, the input of a reduce-scatter.  Activations
count ``dtype_bytes`` per element; context-parallel scan summaries are fp32 (4 bytes) always.
Tensor-parallel payloads grow with ``BATCH * SEQLEN``; context-parallel ones with ``BATCH`` only:
a conv halo is ``d_conv - 1`` steps and a scan summary one state per rank, whatever the length.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from mambac.errors import MambacInputError

BATCH, SEQLEN = sympy.symbols("batch seqlen", positive=True, integer=True)
FP32 = 4


@dataclass(frozen=True)
class Collective:
    """One collective of one layer: what it carries, its kind, mesh axis, pass and bytes."""

    what: str
    kind: str        # all_reduce | all_gather | reduce_scatter
    axis: str        # tp | cp
    direction: str   # forward | backward
    bytes: sympy.Expr


def _family(mixer: torch.nn.Module) -> str:
    name = type(mixer).__name__
    if name not in ("Mamba", "Mamba2", "Mamba3"):
        raise MambacInputError(f"layer_comm knows the mixers Mamba, Mamba2 and Mamba3, not {name}.")
    return name


def _tp_entry_exit(mixer: torch.nn.Module, sequence_parallel: bool, e: int) -> list[Collective]:
    """The residual stream entering in_proj and leaving out_proj (the Megatron pair)."""
    act = BATCH * SEQLEN * mixer.d_model * e
    if sequence_parallel:
        return [Collective("in_proj input", "all_gather", "tp", "forward", act),
                Collective("in_proj input grad", "reduce_scatter", "tp", "backward", act),
                Collective("out_proj output", "reduce_scatter", "tp", "forward", act),
                Collective("out_proj output grad", "all_gather", "tp", "backward", act)]
    return [Collective("in_proj input grad", "all_reduce", "tp", "backward", act),
            Collective("out_proj output", "all_reduce", "tp", "forward", act)]


def _tp_inner(mixer: torch.nn.Module, family: str, tp: int, e: int) -> list[Collective]:
    """Collectives inside the mixer: Mamba-1's x_proj, replicated B/C, a straddling norm group."""
    tokens = BATCH * SEQLEN
    out = []
    if family == "Mamba":
        width = (mixer.dt_rank + 2 * mixer.d_state) * e
        out += [Collective("x_proj output (dt, B, C)", "all_reduce", "tp", "forward", tokens * width),
                Collective("dt, B, C grad", "all_reduce", "tp", "backward", tokens * width)]
        return out
    if mixer.ngroups % tp:
        width = 2 * mixer.ngroups * mixer.d_state * e
        out.append(Collective("replicated B, C grad", "all_reduce", "tp", "backward", tokens * width))
    norm = getattr(mixer, "norm", None)
    norm_groups = norm.weight.numel() // norm.group_size if hasattr(norm, "group_size") else None
    if norm_groups is not None and norm_groups % tp:
        out.append(Collective("gated-norm group sums of squares", "all_reduce", "tp", "forward",
                              tokens * norm_groups * FP32))
    return out


def _local_heads(n: int, tp: int) -> sympy.Expr:
    """The largest per-rank share of ``n`` channels over ``tp`` ranks (first ranks take one more)."""
    return sympy.Integer(-(-n // tp))


def _cp_summaries(mixer: torch.nn.Module, family: str, tp: int) -> sympy.Expr:
    """fp32 elements of one rank's scan summary (final state + total decay, Mamba-3 also angle, k, v)."""
    n = mixer.d_state
    if family == "Mamba":
        return 2 * _local_heads(mixer.d_inner, tp) * n
    h, p = _local_heads(mixer.nheads, tp), mixer.headdim
    if family == "Mamba2":
        return h * p * n + h
    r, s = getattr(mixer, "mimo_rank", 1), mixer.num_rope_angles
    return h * s + h * p * n + r * h * n + h * p + 2 * h


def _cp(mixer: torch.nn.Module, family: str, tp: int, cp: int, e: int) -> list[Collective]:
    out = []
    if family != "Mamba3":
        channels = mixer.d_inner if family == "Mamba" else mixer.d_ssm + 2 * mixer.ngroups * mixer.d_state
        halo = cp * BATCH * _local_heads(channels, tp) * (mixer.d_conv - 1) * e
        out += [Collective("conv halo", "all_gather", "cp", "forward", halo),
                Collective("conv halo grad", "reduce_scatter", "cp", "backward", halo)]
    summary = cp * BATCH * _cp_summaries(mixer, family, tp) * FP32
    out += [Collective("scan summaries", "all_gather", "cp", "forward", summary),
            Collective("scan summaries grad", "reduce_scatter", "cp", "backward", summary)]
    return out


def layer_comm(mixer: torch.nn.Module, tp: int = 1, cp: int = 1, sequence_parallel: bool = False,
               dtype_bytes: int = 4) -> list[Collective]:
    """Every collective one mixer runs per step (forward and backward), bytes as formulas.

    Counts the default Megatron layout (no plan overrides); a Mamba-2 gated norm whose groups
    straddle tp ranks adds its sums of squares."""
    family = _family(mixer)
    out: list[Collective] = []
    if tp > 1:
        out += _tp_entry_exit(mixer, sequence_parallel, dtype_bytes) + _tp_inner(mixer, family, tp, dtype_bytes)
    if cp > 1:
        out += _cp(mixer, family, tp, cp, dtype_bytes)
    return out


def total_bytes(collectives: list[Collective], axis: str | None = None) -> sympy.Expr:
    """The summed payload (optionally of one mesh axis), simplified."""
    return sympy.simplify(sum((c.bytes for c in collectives if axis in (None, c.axis)), sympy.Integer(0)))
