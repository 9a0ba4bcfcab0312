"""Graph verifier: run after every pass when ``MAMBAC_VERIFY=1`` (always in tests).

Checks: fx's own lint (topological order, defined names, valid targets); every node that produces
a value carries ``meta['val']`` (shapes are present); placements, where any node has one, are on
every value node and all span the same mesh, and a Shard names a dim the value has; mambac ops
have the argument count of their schema.
"""
from __future__ import annotations

import torch
import torch.fx

from mambac.errors import MambacPassError
from mambac.ir import PLACEMENT, VAL, Placement, Shard
from mambac.ops._common import info_for_target


def verify(gm: torch.fx.GraphModule, stage: str = "?") -> None:
    """Raise MambacPassError naming the stage and the node when the graph is malformed."""
    try:
        gm.graph.lint()
    except Exception as exc:
        raise MambacPassError(f"graph after '{stage}' is malformed: {exc}") from exc
    ndims = set()
    has_placements = any(PLACEMENT in n.meta for n in gm.graph.nodes)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if VAL not in node.meta:
            raise MambacPassError(f"after '{stage}': node '{node.name}' ({node.op} {node.target}) has no shape "
                                  "(meta['val']); the pass that created it must set it (use passes.rewrite).")
        info = info_for_target(node.target) if node.op == "call_function" else None
        if info is not None and len(node.args) + len(node.kwargs) != len(info.arg_names):
            raise MambacPassError(f"after '{stage}': {info.name} node '{node.name}' has "
                                  f"{len(node.args) + len(node.kwargs)} arguments, its schema {len(info.arg_names)}.")
        if has_placements and isinstance(node.meta[VAL], torch.Tensor):
            if PLACEMENT not in node.meta:
                raise MambacPassError(f"after '{stage}': node '{node.name}' has no placement while others do.")
            _check_placement(node, node.meta[PLACEMENT], node.meta[VAL], stage)
            ndims.add(len(node.meta[PLACEMENT].per_mesh_dim))
    if len(ndims) > 1:
        raise MambacPassError(f"after '{stage}': placements span different mesh ranks {sorted(ndims)}.")


def _check_placement(node: torch.fx.Node, pl, val: torch.Tensor, stage: str) -> None:
    if not isinstance(pl, Placement):
        raise MambacPassError(f"after '{stage}': tensor node '{node.name}' has placement {pl} (expected one Placement).")
    for p in pl.per_mesh_dim:
        if isinstance(p, Shard) and not 0 <= p.dim < max(val.dim(), 1):
            raise MambacPassError(f"after '{stage}': node '{node.name}' is {pl} but has only {val.dim()} dims.")
