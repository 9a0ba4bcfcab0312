"""``cancel_redundant_comms``: fold collective pairs that ``insert_collectives`` placed naively.

Needs: ``insert_collectives``.  Guarantees: the same values and gradients with fewer collectives:

- ``grad_all_reduce(all_gather(x))`` → ``all_gather_rs(x)``: a gather whose result feeds a
  split op needs its gradient summed and re-split; one reduce-scatter in backward does both
  (sequence parallelism: one all-gather forward, one reduce-scatter backward per mixer entry);
- ``shard_slice(all_gather(x, d), d)`` → ``x``: gathering and re-splitting the same way is nothing;
- two identical collectives of the same value → one.

Counts in ``ctx.stats['cancel_redundant_comms']``; dead collectives are left to
``eliminate_dead_code``.
"""
from __future__ import annotations

import torch
import torch.fx

from mambac.ir import PLACEMENT
from mambac.passes.context import PassContext
from mambac.passes.rewrite import insert_before, replace_uses
from mambac.runtime.collectives import collective_name

NAME = "cancel_redundant_comms"


def _fuse_gather_grad(node: torch.fx.Node) -> bool:
    """all_gather feeding only grad_all_reduce nodes (and shape reads) → all_gather_rs."""
    if collective_name(node) != "all_gather":
        return False
    grads = [u for u in node.users if collective_name(u) == "grad_all_reduce"]
    tensor_users = [u for u in node.users if not (u.op == "call_function" and u.target is getattr)]
    if not grads or len(grads) != len(tensor_users):
        return False
    fused = insert_before(node, "call_function", torch.ops.mambac.all_gather_rs.default, node.args,
                          created_by=NAME)
    fused.meta[PLACEMENT] = node.meta[PLACEMENT]
    fused.meta["mambac_source"] = node.meta.get("mambac_source")
    for g in grads:
        replace_uses(g, fused)
    replace_uses(node, fused)
    return True


def _cancel_gather_slice(node: torch.fx.Node) -> bool:
    if collective_name(node) != "shard_slice":
        return False
    src = node.args[0]
    if collective_name(src) != "all_gather" or src.args[1] != node.args[1] or src.args[3:] != node.args[2:]:
        return False
    replace_uses(node, src.args[0])
    return True


def _dedupe(gm: torch.fx.GraphModule) -> int:
    seen: dict[tuple, torch.fx.Node] = {}
    n = 0
    for node in list(gm.graph.nodes):
        if collective_name(node) is None:
            continue
        key = (node.target, node.args)
        if key in seen:
            replace_uses(node, seen[key])
            n += 1
        else:
            seen[key] = node
    return n


def cancel_redundant_comms(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    stats = ctx.stats_for(NAME)
    stats.add("duplicates", _dedupe(gm))
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False):
            continue
        if _fuse_gather_grad(node):
            stats.add("gather_grad_fused")
        elif _cancel_gather_slice(node):
            stats.add("gather_slice_cancelled")
    gm.recompile()
    return gm
