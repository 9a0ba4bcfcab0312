"""Rank-local rewrites ``propagate_sharding`` applies to mambac ops that see split heads.

- ``select_groups``: B/C replicated (tp does not divide ngroups) while the heads are split: each
  rank keeps the groups its heads read, so the op's head -> group mapping stays right locally.
- ``split_norm``: a grouped RMSNorm whose groups straddle ranks: per-group partial sums of squares
  (a Partial value, all-reduced by ``insert_collectives``), then the local normalisation.
"""
from __future__ import annotations

import torch.fx

from mambac.ir import PLACEMENT, SOURCE, VAL, WANTS, Partial, Placement, Replicate, Shard, source_of
from mambac.ops._common import info_for_target
from mambac.passes.rewrite import insert_before, op_arg, replace_uses, set_op_args
from mambac.passes.sharding_ops import _args
from mambac.runtime import parallel_ops as pops

R = Replicate()


def _val(node):
    return node.meta.get(VAL) if isinstance(node, torch.fx.Node) else None


# op -> (its per-head input, B's group dim, B's rank when grouped); a 3-D B of selective_scan is shared
GROUPED = {"ssd": ("x", 2, 4), "mamba3_siso": ("x", 2, 4), "mamba3_mimo": ("x", 3, 5), "selective_scan": ("u", 1, 4)}


def _tp(node):
    pl = node.meta.get(PLACEMENT) if isinstance(node, torch.fx.Node) else None
    return pl.on("tp") if isinstance(pl, Placement) else None


def _heads_of(p: Shard) -> list[int]:
    out, offset = [], 0
    for s in p.segments:
        out.extend(range(offset + s.start, offset + s.start + s.size))
        offset += s.total
    return out


def needs_group_select(st, node) -> bool:
    info = info_for_target(node.target) if node.op == "call_function" else None
    if info is None or info.name not in GROUPED or st.mesh.tp == 1:
        return False
    args = _args(node)
    xname, gdim, rank = GROUPED[info.name]
    x, B = args[xname], args["B"]
    if not (isinstance(_tp(x), Shard) and _tp(x).segments and isinstance(_tp(B), Replicate)):
        return False
    return _val(B).dim() == rank and _val(B).shape[gdim] > 1


def select_groups(st, node) -> None:
    """Replicated B/C with several groups: keep the groups this rank's heads read (per head when
    the local heads do not cover whole groups evenly)."""
    info = info_for_target(node.target)
    xname, gdim, _ = GROUPED[info.name]
    args = _args(node)
    x = args[xname]
    heads = _heads_of(_tp(x))
    total = sum(s.total for s in _tp(x).segments)
    G = _val(args["B"]).shape[gdim]
    per = total // G
    groups = [h // per for h in heads]
    uniq = sorted(set(groups))
    k = len(groups) // len(uniq)
    chosen = uniq if groups == [g for g in uniq for _ in range(k)] else groups
    for name in ("B", "C"):
        src = args[name]
        sel = insert_before(node, "call_function", pops.select_groups, (src, gdim, tuple(chosen)), created_by="propagate_sharding")
        sel.meta[PLACEMENT] = src.meta[PLACEMENT].with_("tp", Shard(gdim))
        sel.meta[WANTS] = {}
        set_op_args(node, **{name: sel})
    st.stats.add("select_groups")


def needs_split_norm(st, node) -> bool:
    info = info_for_target(node.target) if node.op == "call_function" else None
    if info is None or info.name != "gated_rmsnorm" or st.mesh.tp == 1:
        return False
    p = _tp(op_arg(node, "x"))
    if not (isinstance(p, Shard) and p.dim == _val(node).dim() - 1 and p.segments):
        return False
    gs = op_arg(node, "group_size")
    groups = [c // gs for c in _heads_of(p)]
    return any(groups.count(g) != gs for g in set(groups))


def split_norm(st, node) -> None:
    """A grouped RMSNorm whose groups straddle ranks: per-group partial sums of squares, one
    all-reduce (inserted later), then the normalisation of the local channels."""
    x, w, z = op_arg(node, "x"), op_arg(node, "weight"), op_arg(node, "z")
    eps, gs, nbg = op_arg(node, "eps"), op_arg(node, "group_size"), op_arg(node, "norm_before_gate")
    p = _tp(x)
    groups = tuple(c // gs for c in _heads_of(p))
    ngroups = sum(s.total for s in p.segments) // gs
    sq = insert_before(node, "call_function", pops.group_sumsq, (x, z, groups, ngroups, gs, nbg),
                       created_by="propagate_sharding")
    sq.meta[PLACEMENT] = x.meta[PLACEMENT].with_("tp", Partial())
    out = insert_before(node, "call_function", pops.apply_group_rmsnorm, (x, w, z, sq, groups, eps, nbg),
                        created_by="propagate_sharding")
    out.meta[PLACEMENT] = x.meta[PLACEMENT]
    out.meta[WANTS] = {sq.name: sq.meta[PLACEMENT].with_("tp", R)}
    for n in (sq, out):
        n.meta[SOURCE] = source_of(node)
    replace_uses(node, out)
    st.stats.add("split_group_norm")
