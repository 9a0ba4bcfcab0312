"""Python numbers that dynamo hands the backend as tensors, read back as the numbers they are.

Under ``torch.compile(..., dynamic=True)`` dynamo does not specialise Python floats (a mixer's
``dt_limit``, a norm's ``eps``): each becomes a 0-d graph input read with ``.item()`` (then
``torch.sym_float``), and a value read from a tensor has no size or value for mambac's shape
propagation or its passes.  ``bake_scalars`` puts the number the example inputs carry in place
of those reads, so the graph lowers (and fuses) as with a constant; ``guard_scalars`` makes the
compiled callable check, on every call, that the inputs still carry those numbers, and runs the
graph as dynamo traced it (eager values and gradients) on a call where one differs.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.node import map_aggregate

_CASTS = {torch.sym_float: float, torch.sym_int: int}


def _plain_number_tensor(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return (isinstance(value, torch.Tensor) and not isinstance(value, (FakeTensor, torch.nn.Parameter))
            and value.dim() == 0 and value.device.type == "cpu" and not value.requires_grad)


def _put_constant(node: torch.fx.Node, value: Any) -> None:
    """Every use of ``node`` reads ``value`` instead; ``node`` is then erased."""
    for user in list(node.users):
        user.args = map_aggregate(user.args, lambda a: value if a is node else a)
        user.kwargs = map_aggregate(user.kwargs, lambda a: value if a is node else a)
    node.graph.erase_node(node)


def bake_scalars(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[tuple[int, Any]]:
    """Replace the ``.item()`` reads of 0-d number inputs by their example values, in place;
    returns (input index, value) for each input baked.  Inputs read any other way stay."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(holders) != len(example_inputs):
        return []
    baked = []
    for index, (holder, example) in enumerate(zip(holders, example_inputs)):
        reads = list(holder.users)
        if not reads or not _plain_number_tensor(example):
            continue
        if not all(r.op == "call_method" and r.target == "item" for r in reads):
            continue
        value = example.item()
        for read in reads:
            for cast in [u for u in read.users if u.op == "call_function" and u.target in _CASTS]:
                _put_constant(cast, _CASTS[cast.target](value))
            _put_constant(read, value)
        baked.append((index, value))
    folded = _fold_constant_casts(gm)
    if baked or folded:
        gm.recompile()
    return baked


def _fold_constant_casts(gm: torch.fx.GraphModule) -> int:
    """``torch.sym_float(1e-05)``: a cast of a plain number (what stays of a float dynamo
    specialised after reading it, on torch 2.11) becomes that number; returns how many."""
    casts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _CASTS
             and len(n.args) == 1 and not n.kwargs and isinstance(n.args[0], (int, float))
             and not isinstance(n.args[0], bool)]
    for cast in casts:
        _put_constant(cast, _CASTS[cast.target](cast.args[0]))
    return len(casts)


def guard_scalars(compiled: Callable, traced: torch.fx.GraphModule, baked: list[tuple[int, Any]]) -> Callable:
    """``compiled`` while the baked inputs carry their baked values, ``traced`` (the graph before
    baking) on a call where one does not.  Keeps dynamo's boxed calling convention."""
    boxed = bool(getattr(compiled, "_boxed_call", False))

    def run(*args: Any) -> Any:
        flat = args[0] if boxed else args
        if all(flat[i].item() == value for i, value in baked):
            return compiled(*args)
        out = traced(*flat)
        if boxed:
            flat.clear()
        return out

    run._boxed_call = boxed  # type: ignore[attr-defined]
    return run


def bake(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[list[tuple[int, Any]], Any]:
    """``bake_scalars`` with the untouched graph kept for ``guard_scalars`` (None if nothing was baked)."""
    if not any(_plain_number_tensor(e) for e in example_inputs):
        if _fold_constant_casts(gm):
            gm.recompile()
        return [], None
    traced = copy.deepcopy(gm)
    baked = bake_scalars(gm, example_inputs)
    return baked, (traced if baked else None)
