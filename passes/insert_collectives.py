"""``insert_collectives``: make every placement change explicit as a collective node.

Needs: ``propagate_sharding`` (``meta[PLACEMENT]`` on values, ``meta[WANTS]`` where an input must
change layout), ``gm.meta[MESH]``.
Guarantees: every input an op reads has the placement the op wants, through ``torch.ops.mambac``
collectives (``mambac.runtime.collectives``) inserted right after the value they convert (one per
value and target layout); a replicated input that feeds an op whose result is split or partial on
the tp dimension goes through ``grad_all_reduce`` (identity forward, sum of gradients backward), so
replicated values keep identical gradients on every rank (on dp, DDP reduces parameter gradients);
reads of ``x.shape`` follow a gathered ``x`` to its gathered form (the mixers compute on the whole
sequence under sequence parallelism); shapes are propagated again (local shapes everywhere).
Counts per collective in ``ctx.stats['insert_collectives']``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from mambac.capture import FAKE_MODE_KEY, repropagate
from mambac.errors import MambacPassError
from mambac.ir import MESH, PLACEMENT, SOURCE, VAL, WANTS, Partial, Placement, Placements, Replicate, Shard, source_of
from mambac.passes.context import PassContext
from mambac.passes.rewrite import insert_after, replace_input
import mambac.runtime.collectives  # noqa: F401  (registers the ops)

NAME = "insert_collectives"
OPS = torch.ops.mambac


class _Inserter:
    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        self.gm, self.mesh = gm, gm.meta[MESH]
        self.stats = ctx.stats_for(NAME)
        self.cache: dict[tuple, torch.fx.Node] = {}
        self.sizes: dict[str, torch.fx.Node] = {}
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]

    def anchor(self, node: torch.fx.Node) -> torch.fx.Node:
        """Insert after ``node``; after the last placeholder when ``node`` is one."""
        return self.placeholders[-1] if node.op == "placeholder" else node

    def global_size(self, dim: str) -> torch.fx.Node:
        """The run-time size of the dim split evenly on ``dim``: batch (dp) or sequence (tp)."""
        if dim not in self.sizes:
            src = next((p for p in self.placeholders if isinstance(p.meta.get(VAL), torch.Tensor)
                        and p.meta[VAL].dim() >= 2), None)
            if src is None:
                raise MambacPassError("splitting the batch or sequence needs a tensor input of at least 2 dims.")
            shape = insert_after(self.placeholders[-1], "call_function", getattr, (src, "shape"), created_by=NAME)
            size = insert_after(shape, "call_function", operator.getitem, (shape, 0 if dim == "dp" else 1),
                                created_by=NAME)
            self.sizes[dim] = size
        return self.sizes[dim]

    def emit(self, after: torch.fx.Node, target, args: tuple, placement: Placement, src: torch.fx.Node):
        node = insert_after(after, "call_function", target, args, created_by=NAME)
        node.meta[PLACEMENT] = placement
        node.meta[SOURCE] = type(source_of(src))(source_of(src).module_path, source_of(src).module_type, NAME)
        self.stats.add(target._schema.name.split("::")[-1])
        return node

    def full_size(self, dim: str, p: Shard):
        if p.segments:
            if len(p.segments) != 1:
                raise MambacPassError(f"cannot gather a value split in several segments ({p}); only its consumers "
                                      "inside the split module may read it.")
            return p.segments[0].total
        return self.global_size(dim)

    def step(self, cur: torch.fx.Node, dim: str, have, want, user: torch.fx.Node) -> torch.fx.Node:
        """One collective on mesh dim ``dim``.  Provenance: a reduction belongs to the module that
        produced the partial sums, a gather or slice to the module that reads the value."""
        m = self.mesh
        g = (m.rank(dim), m.size(dim), m.group(dim))
        pl = cur.meta[PLACEMENT].with_(dim, want)
        after = self.anchor(cur)
        if isinstance(have, Partial) and isinstance(want, Replicate):
            return self.emit(after, OPS.all_reduce.default, (cur, *g), pl, cur)
        if isinstance(have, Partial) and isinstance(want, Shard):
            return self.emit(after, OPS.reduce_scatter.default, (cur, want.dim, *g), pl, cur)
        if isinstance(have, Shard) and isinstance(want, Replicate):
            return self.emit(after, OPS.all_gather.default, (cur, have.dim, self.full_size(dim, have), *g), pl, user)
        if isinstance(have, Replicate) and isinstance(want, Shard):
            return self.emit(after, OPS.shard_slice.default, (cur, want.dim, *g), pl, user)
        if isinstance(have, Shard) and isinstance(want, Shard):
            mid = self.step(cur, dim, have, Replicate(), user)
            return self.step(mid, dim, Replicate(), want, user)
        raise MambacPassError(f"no collective turns {have} into {want} (value '{cur.name}').")

    def convert(self, inp: torch.fx.Node, want: Placement, user: torch.fx.Node) -> torch.fx.Node:
        key = (inp, want)
        if key not in self.cache:
            cur = inp
            for dim in reversed(self.mesh.dims):  # tp first: vocab before batch
                have, need = cur.meta[PLACEMENT].on(dim), want.on(dim)
                if have != need:
                    cur = self.step(cur, dim, have, need, user)
            self.cache[key] = cur
            if _gathers(inp, cur):
                _follow_shape_reads(inp, cur)
        return self.cache[key]

    def grad_reduce(self, inp: torch.fx.Node, user: torch.fx.Node) -> torch.fx.Node:
        key = (inp, "grad")
        if key not in self.cache:
            m = self.mesh
            self.cache[key] = self.emit(self.anchor(inp), OPS.grad_all_reduce.default,
                                        (inp, m.tp_rank, m.tp, m.tp_group), inp.meta[PLACEMENT], user)
        return self.cache[key]


def _gathers(src: torch.fx.Node, dst: torch.fx.Node) -> bool:
    a, b = src.meta[PLACEMENT], dst.meta[PLACEMENT]
    return any(isinstance(x, Shard) and not isinstance(y, Shard) for x, y in zip(a.per_mesh_dim, b.per_mesh_dim))


def _follow_shape_reads(src: torch.fx.Node, dst: torch.fx.Node) -> None:
    for user in list(src.users):
        if user.op == "call_function" and user.target is getattr and user.args[1] == "shape":
            replace_input(user, src, dst)
        elif user.op == "call_method" and user.target == "size":
            replace_input(user, src, dst)  # conversions sit right after src: before every reader


def _out_split_on_tp(node: torch.fx.Node) -> bool:
    pl = node.meta.get(PLACEMENT)
    items = pl.items if isinstance(pl, Placements) else (pl,)
    return any(p is not None and not isinstance(p.on("tp"), Replicate) for p in items)


def _needs_grad_reduce(inp: torch.fx.Node) -> bool:
    v, pl = inp.meta.get(VAL), inp.meta.get(PLACEMENT)
    return isinstance(v, torch.Tensor) and v.is_floating_point() and isinstance(pl, Placement) \
        and isinstance(pl.on("tp"), Replicate)


def insert_collectives(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    ins = _Inserter(gm, ctx)
    for node in list(gm.graph.nodes):
        wants = node.meta.pop(WANTS, None) or {}
        for inp in list(node.all_input_nodes):
            if inp.name in wants:
                replace_input(node, inp, ins.convert(inp, wants[inp.name], node))
        if node.op == "output" or ins.mesh.tp == 1 or not _out_split_on_tp(node) or node.target is torch.cat:
            continue  # a cat puts its replicated inputs into replicated segments: no partial gradient
        for inp in list(node.all_input_nodes):
            if _needs_grad_reduce(inp):
                replace_input(node, inp, ins.grad_reduce(inp, node))
    gm.graph.lint()
    gm.recompile()
    repropagate(gm, gm.meta[FAKE_MODE_KEY], [n.meta[VAL] for n in gm.graph.nodes if n.op == "placeholder"])
    return gm
