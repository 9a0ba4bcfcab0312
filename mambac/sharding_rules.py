"""Sharding rules of mambac's ops: which dims of which arguments may be split across ranks.

An SSM op is *channel parallel*: its heads (or channels) are independent, so a rank can run it on
its own heads as long as every per-head argument holds the same heads.  Arguments shared by groups
of heads (B, C) may instead be replicated.  The batch dim may be split too (data parallelism); the
sequence dim never (the scan runs along it: context parallelism is a different transform).

``OP_RULES[name]`` maps each tensor argument (by schema name) to an ``ArgSpec`` and lists one
``ArgSpec`` per output.  An op module may provide its own rule as ``OpInfo.extra["sharding"]``,
which wins.  Ops without a rule may only see replicated inputs (the documented default), and
``propagate_sharding`` says so naming the op when they don't.
"""
from __future__ import annotations

from dataclasses import dataclass

from mambac.ops._common import info_for_target


@dataclass(frozen=True)
class ArgSpec:
    """batch: the dim that may be split by data parallelism; channel: the dim holding the heads or
    channels (None: the argument is the same for every head and stays replicated); group: the
    argument is shared by groups of heads and may be replicated while the heads are split;
    rowwise: any dim but the last may be split (norms)."""

    batch: int | None = None
    channel: int | None = None
    group: bool = False
    rowwise: bool = False


@dataclass(frozen=True)
class OpRule:
    args: dict[str, ArgSpec]
    outputs: tuple[ArgSpec, ...]


_ACT = lambda ch: ArgSpec(batch=0, channel=ch)  # noqa: E731
_PARAM = lambda ch: ArgSpec(channel=ch)  # noqa: E731
_GROUP = lambda ch: ArgSpec(batch=0, channel=ch, group=True)  # noqa: E731
_ROW = ArgSpec(rowwise=True)

OP_RULES: dict[str, OpRule] = {
    "causal_conv1d": OpRule({"x": _ACT(1), "weight": _PARAM(0), "bias": _PARAM(0), "initial_state": _ACT(1)},
                            (_ACT(1), _ACT(1))),
    "ssd": OpRule({"x": _ACT(2), "dt": _ACT(2), "A": _PARAM(0), "B": _GROUP(2), "C": _GROUP(2), "D": _PARAM(0),
                   "z": _ACT(2), "dt_bias": _PARAM(0), "initial_state": _ACT(1)}, (_ACT(2), _ACT(1))),
    "selective_scan": OpRule({"u": _ACT(1), "delta": _ACT(1), "A": _PARAM(0), "B": _GROUP(1), "C": _GROUP(1),
                              "D": _PARAM(0), "z": _ACT(1), "delta_bias": _PARAM(0), "initial_state": _ACT(1)},
                             (_ACT(1), _ACT(1))),
    "add_rmsnorm": OpRule({"x": _ROW, "residual": _ROW, "weight": ArgSpec()}, (_ROW, _ROW)),
    "gated_rmsnorm": OpRule({"x": ArgSpec(batch=0, channel=-1), "z": ArgSpec(batch=0, channel=-1),
                             "weight": _PARAM(0)}, (ArgSpec(batch=0, channel=-1),)),
    "mamba3_siso": OpRule({"x": _ACT(2), "B": _GROUP(2), "C": _GROUP(2), "dt": _ACT(2), "adt": _ACT(2),
                           "trap": _ACT(2), "angles": _ACT(2), "B_bias": _PARAM(0), "C_bias": _PARAM(0),
                           "D": _PARAM(0), "z": _ACT(2), "initial_angle": _ACT(1), "initial_ssm": _ACT(1),
                           "initial_k": _ACT(1), "initial_v": _ACT(1)},
                          (_ACT(2), _ACT(1), _ACT(1), _ACT(1), _ACT(1))),
    "mamba3_mimo": OpRule({"x": _ACT(2), "B": _GROUP(3), "C": _GROUP(3), "dt": _ACT(2), "adt": _ACT(2),
                           "trap": _ACT(2), "angles": _ACT(2), "B_bias": _PARAM(0), "C_bias": _PARAM(0),
                           "mimo_x": _PARAM(0), "mimo_z": _PARAM(0), "mimo_o": _PARAM(0), "D": _PARAM(0),
                           "z": _ACT(2), "initial_angle": _ACT(1), "initial_ssm": _ACT(1), "initial_k": _ACT(1),
                           "initial_v": _ACT(1)},
                          (_ACT(2), _ACT(1), _ACT(1), _ACT(2), _ACT(1))),  # y is (b, l, r, h, p) without mimo_o
}


def rule_for(target) -> tuple[str, OpRule] | None:
    """(op name, rule) for a mambac op target, or None when it has no rule."""
    info = info_for_target(target)
    if info is None:
        return None
    rule = info.extra.get("sharding") or OP_RULES.get(info.name)
    return (info.name, rule) if rule is not None else None
