"""``fuse_ssm``: fold the elementwise math written around the SSM ops into the ops themselves.

Needs: a captured graph with shapes (``meta['val']``), canonicalised (``canonicalize`` turns method
calls such as ``x.add(y)`` into ``operator.add``).
Guarantees: the program computes the same function; every match is counted in
``ctx.stats['fuse_ssm']`` under its fusion's name; fused ops record what they absorbed in
``meta[FUSION]``; the absorbed nodes are left dead for ``eliminate_dead_code``.

Each fusion is a pattern (the unfused eager math, given in its docstring) and a rewrite that sets the
fused op's arguments.  A match requires that every intermediate value has no other user (add_rmsnorm's sum
excepted: its later readers read the op's residual output instead), so nothing
that someone else reads disappears:

- ``dt_prologue``    ``ssd(x, clamp(softplus(dt + dt_bias), lo, hi), ...)`` → ``ssd(x, dt, dt_bias=..., dt_softplus, dt_min/max)``
- ``delta_prologue`` ``selective_scan(u, softplus(delta + bias[:, None]), ...)`` → ``delta_bias=bias, delta_softplus``
- ``d_skip``         ``ssd(x, ...)[0] + x * D`` (same for ``selective_scan``) → ``D=...``
- ``z_gate``         ``op(...)[0] * silu(z)`` → ``z=...`` (only after the D skip, which the op applies first)
- ``conv_silu``      ``silu(causal_conv1d(x, w, b, activation='none')[0])`` → ``activation='silu'``
- ``add_rmsnorm``    ``add_rmsnorm(a + b, None, w)`` → ``add_rmsnorm(a, b, w)`` (the sum is returned as the residual;
                     later readers of the sum read that output when its dtype is the sum's)
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from mambac.ir import FUSION, fusion_of
from mambac.passes.context import PassContext
from mambac.passes.rewrite import (apply_until_fixed, is_call, is_op, op_arg, output_of, replace_uses, set_op_args,
                            shape)

NAME = "fuse_ssm"
SOFTPLUS = (torch._C._nn.softplus, F.softplus)
SILU = (F.silu,)
ADD = (operator.add, torch.add)
MUL = (operator.mul, torch.mul)
CLAMP = (torch.clamp,)
VIEWS = ("unsqueeze", "reshape", "view", "float", "to", "contiguous")


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return list(node.users) == [user]


def _mark(node: torch.fx.Node, fusion: str) -> None:
    node.meta[FUSION] = fusion_of(node).plus(fusion)


def _vector(node, n: int):
    """A node holding the same n values as ``node`` as a 1-D (n,) tensor, looking through views."""
    while isinstance(node, torch.fx.Node):
        s = shape(node)
        if s == (n,):
            return node
        if s is None or int(torch.tensor(s).prod()) != n or node.op not in ("call_method", "call_function"):
            return None
        if not node.args or not isinstance(node.args[0], torch.fx.Node):
            return None
        if node.op == "call_method" and node.target not in VIEWS:
            return None
        if node.op == "call_function" and node.target not in (torch.unsqueeze, torch.reshape):
            return None
        node = node.args[0]
    return None


def _split_binary(node, targets, want):
    """If ``node`` is a binary op in ``targets`` with one operand satisfying ``want``, return
    (that operand, the other)."""
    if not is_call(node, targets) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if want(a):
        return a, b
    if want(b):
        return b, a
    return None


def _softplus_input(node):
    if not is_call(node, SOFTPLUS):
        return None
    beta = node.kwargs.get("beta", node.args[1] if len(node.args) > 1 else 1)
    thr = node.kwargs.get("threshold", node.args[2] if len(node.args) > 2 else 20)
    return node.args[0] if beta == 1 and thr == 20 else None


def _clamp_bounds(node):
    """(input, lo, hi) for ``x.clamp(min=lo, max=hi)`` / ``torch.clamp`` with float bounds."""
    if not (is_call(node, CLAMP, ("clamp",))):
        return None
    args = list(node.args) + [None] * (3 - len(node.args))
    lo = node.kwargs.get("min", args[1])
    hi = node.kwargs.get("max", args[2])
    if not all(v is None or isinstance(v, (int, float)) for v in (lo, hi)):
        return None
    return node.args[0], float(0.0 if lo is None else lo), float("inf" if hi is None else hi)


def _bias_ok(bias_shape, n: int, axis_from_end: int) -> bool:
    """The bias broadcasts along the channel axis (``axis_from_end`` = 1 for the last dim)."""
    if bias_shape is None or len(bias_shape) < axis_from_end:
        return False
    rest = [d for i, d in enumerate(reversed(bias_shape), 1) if i != axis_from_end]
    return bias_shape[-axis_from_end] == n and all(d == 1 for d in rest)


def _prologue(op_node, dt_name, bias_name, softplus_name, n: int, axis_from_end: int, with_clamp: bool) -> bool:
    dt = op_arg(op_node, dt_name)
    if op_arg(op_node, bias_name) is not None or op_arg(op_node, softplus_name):
        return False
    lo, hi, sp = 0.0, float("inf"), dt
    if with_clamp and op_arg(op_node, "dt_min") == 0.0 and op_arg(op_node, "dt_max") == float("inf"):
        got = _clamp_bounds(dt)
        if got is not None and _only_user(dt, op_node):
            sp, lo, hi = got
    pre = _softplus_input(sp)
    if pre is None or not _only_user(sp, op_node if sp is dt else dt):
        return False
    parts = _split_binary(pre, ADD, lambda a: _bias_ok(shape(a), n, axis_from_end) and _vector(a, n) is not None)
    if parts is None or not _only_user(pre, sp):
        return False
    bias, raw = parts
    updates = {dt_name: raw, bias_name: _vector(bias, n), softplus_name: True}
    if with_clamp:
        updates.update(dt_min=lo, dt_max=hi)
    set_op_args(op_node, **updates)
    _mark(op_node, "dt_prologue" if dt_name == "dt" else "delta_prologue")
    return True


def _dt_prologue(node: torch.fx.Node) -> bool:
    if not is_op(node, torch.ops.mambac.ssd):
        return False
    h = shape(op_arg(node, "A"))[0]
    return _prologue(node, "dt", "dt_bias", "dt_softplus", h, 1, with_clamp=True)


def _delta_prologue(node: torch.fx.Node) -> bool:
    if not is_op(node, torch.ops.mambac.selective_scan):
        return False
    d = shape(op_arg(node, "A"))[0]
    return _prologue(node, "delta", "delta_bias", "delta_softplus", d, 2, with_clamp=False)


def _scan_output(node, packet):
    """The op node if ``node`` is output 0 of a ``packet`` op."""
    op_node = output_of(node, 0)
    return op_node if op_node is not None and is_op(op_node, packet) else None


_SCANS = {
    "ssd": ("x", lambda n: shape(op_arg(n, "A"))[0]),
    "selective_scan": ("u", lambda n: shape(op_arg(n, "A"))[0]),
}


def _d_value(op_name: str, d_expr, channels: int, x_shape):
    """The D argument for the op from the expression multiplied with x, or None."""
    s = shape(d_expr)
    if s is None:
        return None
    if op_name == "ssd" and len(s) == 2 and s[0] == channels and s[1] == x_shape[-1] and s[1] != 1:
        return d_expr  # (h, p): per head and head dim
    if len(s) == 2 and s == (channels, 1):
        return _vector(d_expr, channels)
    return None


def _epilogue(node: torch.fx.Node, targets, free_args: tuple[str, ...]):
    """If ``node`` is ``targets(op(...)[0], other)`` for a scan op whose ``free_args`` are unset and
    whose output only ``node`` reads, return (op name, op node, that output, other)."""
    for op_name in _SCANS:
        packet = getattr(torch.ops.mambac, op_name)
        parts = _split_binary(node, targets, lambda a: _scan_output(a, packet) is not None)
        if parts is None:
            continue
        y, other = parts
        op_node = _scan_output(y, packet)
        if all(op_arg(op_node, a) is None for a in free_args) and _only_user(y, node):
            return op_name, op_node, y, other
    return None


def _fold(node: torch.fx.Node, op_node: torch.fx.Node, y: torch.fx.Node, fusion: str, **updates) -> bool:
    set_op_args(op_node, **updates)
    replace_uses(node, y)
    _mark(op_node, fusion)
    return True


def _d_skip(node: torch.fx.Node) -> bool:
    got = _epilogue(node, ADD, ("D", "z"))
    if got is None:
        return False
    op_name, op_node, y, prod = got
    x_name, channels_of = _SCANS[op_name]
    x = op_arg(op_node, x_name)
    xd = _split_binary(prod, MUL, lambda a: a is x)
    if xd is None or not _only_user(prod, node):
        return False
    D = _d_value(op_name, xd[1], channels_of(op_node), shape(x))
    return D is not None and _fold(node, op_node, y, "d_skip", D=D)


def _z_gate(node: torch.fx.Node) -> bool:
    got = _epilogue(node, MUL, ("z",))
    if got is None:
        return False
    op_name, op_node, y, gate = got
    if not is_call(gate, SILU) or gate.kwargs.get("inplace", False) or not _only_user(gate, node):
        return False
    z = gate.args[0]
    return shape(z) == shape(op_arg(op_node, _SCANS[op_name][0])) and _fold(node, op_node, y, "z_gate", z=z)


def _conv_silu(node: torch.fx.Node) -> bool:
    if not is_call(node, SILU) or node.kwargs.get("inplace", False):
        return False
    y = node.args[0]
    conv = _scan_output(y, torch.ops.mambac.causal_conv1d)
    if conv is None or op_arg(conv, "activation") != "none" or not _only_user(y, node):
        return False
    return _fold(node, conv, y, "conv_silu", activation="silu")


def _later_users(total: torch.fx.Node, node: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The users of ``total`` besides ``node``, if every one comes after ``node`` (they can then
    read the op's residual output instead); None otherwise."""
    others = [u for u in total.users if u is not node]
    if not others:
        return []
    after, seen = set(), False
    for n in node.graph.nodes:
        if seen:
            after.add(n)
        seen = seen or n is node
    return others if all(u in after for u in others) else None


def _add_rmsnorm(node: torch.fx.Node) -> bool:
    if not is_op(node, torch.ops.mambac.add_rmsnorm) or op_arg(node, "residual") is not None:
        return False
    total = op_arg(node, "x")
    if not is_call(total, ADD) or len(total.args) != 2:
        return False
    a, b = total.args
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)) or shape(a) != shape(b):
        return False
    out_dtype = total.meta["val"].dtype
    x, res = (a, b) if a.meta["val"].dtype == out_dtype else (b, a)
    others = _later_users(total, node)
    # the sum read again later (a block's next residual) comes from the op's residual output,
    # which has x's dtype, i.e. the sum's, unless residual_in_fp32 widens it
    if others is None or (others and (x.meta["val"].dtype != out_dtype or op_arg(node, "residual_in_fp32"))):
        return False
    set_op_args(node, x=x, residual=res)
    if others:
        with node.graph.inserting_after(node):
            summed = node.graph.call_function(operator.getitem, (node, 1))
        summed.meta.update({k: v for k, v in total.meta.items()})
        for user in others:
            user.replace_input_with(total, summed)
    _mark(node, "add_rmsnorm")
    return True


# Order matters: the D skip must be folded before the z gate (the op applies D, then the gate).
RULES = (
    ("dt_prologue", _dt_prologue),
    ("delta_prologue", _delta_prologue),
    ("d_skip", _d_skip),
    ("z_gate", _z_gate),
    ("conv_silu", _conv_silu),
    ("add_rmsnorm", _add_rmsnorm),
)


def fuse_ssm(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Apply every fusion rule over the graph once, in order, counting matches."""
    stats = ctx.stats_for(NAME)
    for name, rule in RULES:
        stats.add(name, apply_until_fixed(gm.graph, rule))
    gm.recompile()
    return gm
