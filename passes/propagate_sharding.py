"""``propagate_sharding``: a placement (Shard / Replicate / Partial per mesh dim) on every value.

Needs: a per-rank graph captured from the rank's local model (``mambac.sharding_plan.local_model``: its
parameters are the local shards, its shapes the local ones), with ``gm.meta[PLAN]`` (the rank's
``RankPlan``) and ``gm.meta[MESH]`` (the ``MeshSpec``).
Guarantees: every tensor value has ``meta[PLACEMENT]`` (``Placements`` for multi-output nodes);
every node whose inputs must change layout first has ``meta[WANTS]`` = {input name: Placement}
(for ``insert_collectives``); no collective is inserted yet.  Layer forms that differ under
tensor parallelism are rewritten here (``mambac.runtime.parallel_ops``): the vocab-parallel
embedding, the vocab-parallel cross-entropy (sum and count, so data-parallel means are exact),
row-parallel linears with a bias (the bias is added after the reduction), B/C group selection when
they are replicated, and gated norms whose groups straddle ranks.  Counts in ``ctx.stats``.

Rules (``passes/sharding_ops.py`` for the generic ones, ``mambac.sharding_rules`` for mambac ops):
parameters take their plan layout on tp and Replicate on dp; inputs are split along the batch on dp;
a Partial value is only passed through linear ops (add of partials, casts) and otherwise wanted
reduced, to Shard(seq) in front of norms under sequence parallelism, to Replicate elsewhere.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from mambac.errors import MambacPassError
from mambac.ir import MESH, PLACEMENT, PLAN, SOURCE, VAL, WANTS, Partial, Placement, Placements, Replicate, Shard, source_of
from mambac.passes import sharding_ops as so
from mambac.passes import sharding_rewrites as sr
from mambac.passes.context import PassContext
from mambac.passes.rewrite import insert_before, replace_uses
from mambac.runtime import parallel_ops as pops
from mambac.sharding_rules import rule_for

NAME = "propagate_sharding"
PRESET = "mambac_preset_placement"  # set on nodes whose placement a rewrite fixed already
WHOLE_INPUT = "mambac_whole_input"  # a linear that must read its input replicated over tp
R = Replicate()


class _State:
    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        self.gm, self.mesh, self.plan = gm, gm.meta[MESH], gm.meta[PLAN]
        self.stats = ctx.stats_for(NAME)
        self.sharded_paths = tuple(p for p in self.plan.kinds)

    # -- placements of inputs ------------------------------------------------------------------
    def stored(self, node) -> Placement | Placements | None:
        return node.meta.get(PLACEMENT) if isinstance(node, torch.fx.Node) else None

    def effective(self, node, dim: str):
        """Placement on ``dim`` that consumers see (placeholders enter split along the batch on dp)."""
        if not isinstance(node, torch.fx.Node) or not isinstance(node.meta.get(VAL), torch.Tensor):
            return None
        if node.op == "placeholder" and dim == "dp" and self.mesh.dp > 1 and node.meta[VAL].dim() >= 1:
            return Shard(0)
        pl = node.meta.get(PLACEMENT)
        return pl.on(dim) if isinstance(pl, Placement) else None

    def in_module(self, node) -> bool:
        path = source_of(node).module_path
        return any(path == p or path.startswith(p + ".") for p in self.sharded_paths)

    def set(self, node, per_dim: dict[str, object], wants: dict[str, dict]) -> None:
        dims = self.mesh.dims
        out = [per_dim[d] for d in dims]
        if any(isinstance(o, tuple) for o in out):
            n = max(len(o) for o in out if isinstance(o, tuple))
            cols = [o if isinstance(o, tuple) else (o,) * n for o in out]
            node.meta[PLACEMENT] = Placements(tuple(
                None if any(c[i] is None for c in cols) else Placement(tuple(c[i] for c in cols), dims)
                for i in range(n)))
        elif all(o is not None for o in out):
            node.meta[PLACEMENT] = Placement(tuple(out), dims)
        merged: dict[str, Placement] = {}
        for inp in node.all_input_nodes:
            per = {d: wants[d].get(inp, self.effective(inp, d)) for d in dims}
            if any(per[d] is None for d in dims):
                continue
            want = Placement(tuple(per[d] for d in dims), dims)
            if want != inp.meta.get(PLACEMENT):
                merged[inp.name] = want
        if merged:
            node.meta[WANTS] = merged


def _param_placement(st: _State, node: torch.fx.Node, dim: str):
    if dim == "dp" or not isinstance(node.meta.get(VAL), torch.Tensor):
        return R
    layout = st.plan.layout_of(str(node.target))
    return R if layout is None else Shard(layout.dim, layout.segments)


def _visit(st: _State, node: torch.fx.Node) -> None:
    if node.meta.get(PRESET):
        return
    if node.op == "output":
        _output(st, node)
        return
    if not _is_tensorish(node.meta.get(VAL)):
        return
    per_dim, wants = {}, {}
    for dim in st.mesh.dims:
        if node.op == "placeholder":
            per_dim[dim], wants[dim] = R, {}
        elif node.op == "get_attr":
            per_dim[dim], wants[dim] = _param_placement(st, node, dim), {}
        else:
            per_dim[dim], wants[dim] = _rule(st, node, dim)
    st.set(node, per_dim, wants)


def _is_tensorish(val) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


def _rule(st: _State, node: torch.fx.Node, dim: str):
    ins = {n: st.effective(n, dim) for n in node.all_input_nodes}
    if node.op == "call_module":
        mod = st.gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Linear):
            return so.linear(node, ins, node.args[0], _param_node_placement(st, f"{node.target}.weight", dim),
                             None if mod.bias is None else _param_node_placement(st, f"{node.target}.bias", dim))
        if isinstance(mod, nn.Embedding):  # a lookup keeps the ids' layout (its table is replicated here)
            return so.embedding(node, ins)
        return so.nn_module(node, ins, mod, dim)   # torch.nn's other modules by table, else replicated only
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
            and isinstance(st.stored(node.args[0]), Placements):
        return st.stored(node.args[0]).items[node.args[1]].on(dim), {}
    found = rule_for(node.target) if node.op == "call_function" else None
    if found is not None:
        return so.channel_op(node, ins, found[0], found[1], st, dim)
    if node.op == "call_function" and node.target is F.linear:
        w = node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if node.meta.get(WHOLE_INPUT) and dim == "tp":
            return R, ({} if isinstance(ins.get(node.args[0]), Replicate) else {node.args[0]: R})
        return so.linear(node, ins, node.args[0], ins.get(w), ins.get(b) if b is not None else None)
    if node.op == "call_function" and node.target is pops.vocab_parallel_embedding:
        return (Partial() if dim == "tp" else ins[node.args[0]]), {}
    return so.generic(node, ins, st, dim)


def _param_node_placement(st: _State, name: str, dim: str):
    if dim == "dp":
        return R
    layout = st.plan.layout_of(name)
    return R if layout is None else Shard(layout.dim, layout.segments)


def _output(st: _State, node: torch.fx.Node) -> None:
    if st.mesh.output == "sharded":
        return
    wants = {}
    for inp in node.all_input_nodes:
        if isinstance(inp.meta.get(PLACEMENT), Placement) and not inp.meta[PLACEMENT].replicated:
            wants[inp.name] = st.mesh.replicated()
    if wants:
        node.meta[WANTS] = wants


# ---- rewrites of layers whose tensor-parallel form differs -------------------------------------

def _rewrite_embedding(st: _State, node: torch.fx.Node) -> None:
    layout = st.plan.layout_of(f"{node.target}.weight")
    if layout is None:
        return
    w = insert_before(node, "get_attr", f"{node.target}.weight", (), created_by=NAME)
    emb = insert_before(node, "call_function", pops.vocab_parallel_embedding,
                        (node.args[0], w, layout.segments[0].start), created_by=NAME)
    emb.meta[SOURCE] = source_of(node)
    replace_uses(node, emb)
    st.stats.add("vocab_parallel_embedding")


def _rewrite_row_bias(st: _State, node: torch.fx.Node) -> None:
    layout = st.plan.layout_of(f"{node.target}.weight")
    mod = st.gm.get_submodule(str(node.target))
    if layout is None or layout.dim != 1 or mod.bias is None:
        return
    w = insert_before(node, "get_attr", f"{node.target}.weight", (), created_by=NAME)
    b = insert_before(node, "get_attr", f"{node.target}.bias", (), created_by=NAME)
    lin = insert_before(node, "call_function", F.linear, (node.args[0], w), created_by=NAME)
    add = insert_before(node, "call_function", operator.add, (lin, b), created_by=NAME)
    replace_uses(node, add)
    st.stats.add("row_parallel_bias")


def _runs(segments) -> list[tuple[bool, tuple]]:
    """Consecutive segments grouped by whether they are replicated (empty ones join a neighbour)."""
    runs: list[tuple[bool, list]] = []
    for seg in segments:
        rep = seg.replicated and seg.size > 0
        if runs and (runs[-1][0] == rep or seg.size == 0):
            runs[-1][1].append(seg)
        else:
            runs.append((rep, [seg]))
    return [(rep, tuple(segs)) for rep, segs in runs]


def _rewrite_mixed_column(st: _State, node: torch.fx.Node) -> None:
    """A column-parallel linear whose rows are partly replicated (Mamba-2's B/C when tp does not
    divide ngroups) runs as one linear per run of rows, concatenated: the replicated rows must not
    have their input gradient summed over the ranks (every rank computes the same), the split rows
    must.  Same arithmetic, same output layout."""
    layout = st.plan.layout_of(f"{node.target}.weight")
    if layout is None or layout.dim != 0:
        return
    runs = _runs(layout.segments)
    if len(runs) < 2 or not any(rep for rep, _ in runs):
        return
    mod = st.gm.get_submodule(str(node.target))
    w = insert_before(node, "get_attr", f"{node.target}.weight", (), created_by=NAME)
    b = None if mod.bias is None else insert_before(node, "get_attr", f"{node.target}.bias", (), created_by=NAME)
    for n in (w, b):
        if n is not None:
            _visit(st, n)
    pieces, offset = [], 0
    for rep, segs in runs:
        size = sum(sg.size for sg in segs)
        parts = []
        for src in (w, b):
            if src is None:
                parts.append(None)
                continue
            cut = insert_before(node, "call_function", operator.getitem, (src, slice(offset, offset + size)),
                                created_by=NAME)
            cut.meta[PLACEMENT] = src.meta[PLACEMENT].with_("tp", R if rep else Shard(0, segs))
            cut.meta[PRESET] = True
            parts.append(cut)
        args = (node.args[0], parts[0]) if parts[1] is None else (node.args[0], parts[0], parts[1])
        pieces.append(insert_before(node, "call_function", F.linear, args, created_by=NAME))
        if rep:
            pieces[-1].meta[so.SEGMENTS_HINT] = segs  # keeps the names of the replicated segments
            pieces[-1].meta[WHOLE_INPUT] = True       # reads the same (gathered) input as its siblings
        offset += size
    out = insert_before(node, "call_function", torch.cat, (pieces,), {"dim": -1}, created_by=NAME)
    for n in pieces + [out]:
        n.meta[SOURCE] = source_of(node)
    replace_uses(node, out)
    st.stats.add("mixed_column_linear")


def _rewrite_modules(st: _State) -> None:
    for node in list(st.gm.graph.nodes):
        if node.op != "call_module":
            continue
        mod = st.gm.get_submodule(str(node.target))
        if isinstance(mod, nn.Embedding):
            _rewrite_embedding(st, node)
        elif isinstance(mod, nn.Linear):
            _rewrite_row_bias(st, node)
            if node.graph is not None and not getattr(node, "_erased", False):
                _rewrite_mixed_column(st, node)


def _rewrite_cross_entropy(st: _State, node: torch.fx.Node) -> None:
    """F.cross_entropy(logits, labels, mean) on sharded logits → (sum of losses) / (token count)."""
    logits, labels = node.args[0], node.args[1]
    kw = dict(node.kwargs)
    ignore = kw.get("ignore_index", -100)
    if kw.get("reduction", "mean") != "mean" or kw.get("weight") is not None or kw.get("label_smoothing", 0.0):
        raise MambacPassError("cross_entropy under tensor/data/context parallelism supports reduction='mean' without "
                              "class weights or label smoothing; compute other losses from the gathered logits.")
    vocab = st.effective(logits, "tp")
    tp_layout = st.plan.layout_of("lm_head.weight")
    if isinstance(vocab, Shard) and tp_layout is not None:
        args = (logits, labels, tp_layout.segments[0].start, ignore, st.mesh.tp_rank, st.mesh.tp, st.mesh.tp_group)
        total = insert_before(node, "call_function", pops.vocab_parallel_ce_sum, args, created_by=NAME)
        st.stats.add("vocab_parallel_cross_entropy")
    else:
        total = insert_before(node, "call_function", pops.ce_sum, (logits, labels, ignore), created_by=NAME)
    count = insert_before(node, "call_function", pops.token_count, (labels, ignore), created_by=NAME)
    mean = insert_before(node, "call_function", operator.truediv, (total, count), created_by=NAME)
    replace_uses(node, mean)
    for n in (total, count, mean):
        _visit(st, n)


def _needs_parallel_ce(st: _State, node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not F.cross_entropy:
        return False
    return st.mesh.dp > 1 or st.mesh.cp > 1 or isinstance(st.effective(node.args[0], "tp"), Shard)


def propagate_sharding(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    st = _State(gm, ctx)
    _rewrite_modules(st)
    for node in list(gm.graph.nodes):
        if _needs_parallel_ce(st, node):
            _rewrite_cross_entropy(st, node)
            continue
        if sr.needs_group_select(st, node):
            sr.select_groups(st, node)
        if sr.needs_split_norm(st, node):
            sr.split_norm(st, node)
            continue
        _visit(st, node)
    gm.recompile()
    return gm

