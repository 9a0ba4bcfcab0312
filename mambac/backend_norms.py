"""transformers' Mamba / Mamba-2 RMSNorm modules inside a dynamo graph, as ``mambac::add_rmsnorm``.

HF's ``MambaRMSNorm`` / ``Mamba2RMSNorm`` (the blocks' norms and ``norm_f``) trace into six
elementwise nodes (cast, square, mean, rsqrt, two products).  Each region whose module is reachable
from the frame dynamo compiles, whose only inputs are its weight and one tensor, whose value leaves
it once, and whose input, weight and output share one dtype (so HF's casts to fp32 and back are
exactly what the op does) becomes one ``add_rmsnorm(x, None, weight, eps)`` node, i.e. the
generated RMSNorm kernels on CUDA.  HF's blocks cast the residual sum to the weight's dtype before
the norm (``.to(weight.dtype)``); where that cast changes nothing in this graph it is dropped, so
``fuse_ssm`` folds the sum into the op and the next block's residual reads the op's residual
output.
"""
from __future__ import annotations

import logging
import operator
from typing import Any, Sequence

import torch
import torch.fx

from mambac.backend_foreign import (HF_MIXERS, Refused, Region, check_no_break_inside, find_regions, node_value,
                                    param_inputs, resolve, size_like)
from mambac.dynamo_paths import dotted, qualname
from mambac.ir import SOURCE, SourceInfo

log = logging.getLogger("mambac.backend")

HF_NORMS = ("transformers.models.mamba.modeling_mamba.MambaRMSNorm",
            "transformers.models.mamba2.modeling_mamba2.Mamba2RMSNorm")


def _swap_norm(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], region: Region, f_locals: dict) -> None:
    norm = resolve(region.raw_path, f_locals)
    if norm is None or qualname(type(norm)) != region.cls:
        raise Refused("the module at that path is not reachable from the frame dynamo compiled")
    check_no_break_inside(gm, norm)
    params, others = param_inputs(gm, example_inputs, region, norm)
    if set(params) != {"weight"} or len(others) != 1:
        raise Refused("its inputs are not its weight and one tensor")
    inside = set(region.nodes)
    outs = [n for n in region.nodes if any(u not in inside for u in n.users) and not size_like(node_value(n))]
    if len(outs) != 1:
        raise Refused(f"{len(outs)} of its values are used outside it; exactly one is supported")
    hidden, out, weight = others[0], outs[0], params["weight"]
    h, y, w = node_value(hidden), node_value(out), node_value(weight)
    if not all(isinstance(t, torch.Tensor) for t in (h, y, w)) or h.shape != y.shape \
            or tuple(w.shape) != (h.shape[-1],):
        raise Refused("its input, weight and output do not have the shapes of an RMSNorm")
    if not h.dtype == w.dtype == y.dtype:
        raise Refused(f"its input ({h.dtype}), weight ({w.dtype}) and output ({y.dtype}) dtypes differ")
    eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
    graph = gm.graph
    cast = _noop_cast(hidden, inside)
    source = cast.args[0] if cast is not None else hidden
    with graph.inserting_before(out):
        op = graph.call_function(torch.ops.mambac.add_rmsnorm.default, (source, None, weight, eps, False))
        result = graph.call_function(operator.getitem, (op, 0))
    for node in (op, result):
        node.meta["nn_module_stack"] = dict(region.stack)
        node.meta[SOURCE] = SourceInfo(module_path=dotted(region.raw_path), module_type=type(norm).__name__)
    out.replace_all_uses_with(result)
    for node in reversed(list(graph.nodes)):
        if node in inside and not node.users:
            graph.erase_node(node)
    if cast is not None and not cast.users:
        graph.erase_node(cast)


def _noop_cast(hidden: torch.fx.Node, inside: set) -> torch.fx.Node | None:
    """``hidden`` if it is ``t.to(dtype)`` of a tensor that already has that dtype and only the
    norm reads it (HF's blocks cast the residual sum to the norm weight's dtype): the op then
    reads ``t`` itself, so ``fuse_ssm`` sees the sum.  The graph is dynamo's for this call's
    autocast state (dynamo guards on it), so the dtypes seen here are the ones that run."""
    if hidden.op != "call_method" or hidden.target != "to" or not hidden.args \
            or not isinstance(hidden.args[0], torch.fx.Node) or any(u not in inside for u in hidden.users):
        return None
    src, out = node_value(hidden.args[0]), node_value(hidden)
    extra = set(hidden.kwargs) - {"dtype"}
    if extra or len(hidden.args) > 2 or not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    if src.dtype != out.dtype or src.device != out.device:
        return None
    return hidden


def swap_foreign_norms(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], f_locals: dict) -> int:
    """Replace every HF Mamba RMSNorm region outside a mixer by ``add_rmsnorm``; returns how many.
    Regions that cannot be replaced stay HF's code (logged at info level: they are only slower)."""
    swapped = 0
    for region in find_regions(gm, HF_NORMS).values():
        if any(qualname(cls) in HF_MIXERS for _, cls in region.stack.values()):
            continue
        try:
            _swap_norm(gm, example_inputs, region, f_locals)
            swapped += 1
        except Refused as why:
            log.info("mambac backend: %s at '%s' stays HF's code: %s.", region.cls.rsplit(".", 1)[-1],
                     dotted(region.raw_path), why)
    return swapped
