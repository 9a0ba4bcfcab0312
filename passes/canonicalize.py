"""``canonicalize``: one spelling per operation, so later patterns match one form.

Needs: a captured graph with shapes.  Guarantees: the same function; ``x.add(y)``/``torch.add(x, y)``
become ``operator.add`` (likewise mul, sub, neg) and ``x.clamp(...)`` becomes ``torch.clamp``,
counted in ``ctx.stats['canonicalize']['rewritten']``.  Dtype-dependent simplifications are not made:
dtypes may differ at run time (autocast) from those seen at capture.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from mambac.passes.context import PassContext

NAME = "canonicalize"
_METHODS = {"add": operator.add, "mul": operator.mul, "sub": operator.sub, "neg": operator.neg}
_FUNCS = {torch.add: operator.add, torch.mul: operator.mul, torch.sub: operator.sub, torch.neg: operator.neg}


def _binary_without_extras(node: torch.fx.Node) -> bool:
    return not node.kwargs and len(node.args) == (1 if node.target in ("neg", torch.neg) else 2)


def canonicalize(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    stats = ctx.stats_for(NAME)
    for node in gm.graph.nodes:
        new_target = None
        if node.op == "call_method" and node.target in _METHODS and _binary_without_extras(node):
            new_target = _METHODS[node.target]
        elif node.op == "call_function" and node.target in _FUNCS and _binary_without_extras(node):
            new_target = _FUNCS[node.target]
        elif node.op == "call_method" and node.target == "clamp":
            node.op, node.target = "call_function", torch.clamp
            stats.add("rewritten")
            continue
        if new_target is not None:
            node.op, node.target = "call_function", new_target
            stats.add("rewritten")
    gm.recompile()
    return gm
