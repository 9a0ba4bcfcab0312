"""Placement rules of ordinary PyTorch operations, used by ``propagate_sharding``.

A rule sees one mesh dimension at a time: the node, its tensor inputs' placements on that dimension,
and returns (output placement, {input node: wanted placement}).  Wanted placements that differ from
an input's are turned into collectives by ``insert_collectives``.  Shard dims are non-negative;
``Shard.segments`` follow a dim through views (scaled when heads are unflattened to (h, p)).
"""
from __future__ import annotations

import math

import torch
import torch.fx

from mambac.errors import MambacPassError
from mambac.ir import GLOBAL_SHAPES, VAL, Partial, Replicate, Segment, Shard, source_of
from mambac.ops._common import info_for_target
from mambac.runtime import parallel_ops as pops
from mambac.sharding_rules import ArgSpec

R = Replicate()
SEGMENTS_HINT = "mambac_segments_hint"  # a replicated value's segments, for when it is concatenated
POINTWISE = {"add", "sub", "mul", "truediv", "div", "neg", "exp", "log", "sigmoid", "tanh", "clamp", "reciprocal",
             "sqrt", "rsqrt", "silu", "softplus", "gelu", "relu", "pow", "abs", "float", "to", "contiguous",
             "type_as", "clone", "expm1", "log1p", "square", "minimum", "maximum", "sin", "cos", "floor", "where",
             "double", "half", "bfloat16", "detach"}
LINEAR_UNARY = {"float", "to", "contiguous", "clone", "type_as", "neg", "double", "half", "bfloat16"}


def _name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", str(node.target))


def _val(node):
    return node.meta.get(VAL) if isinstance(node, torch.fx.Node) else None


def _fail(node: torch.fx.Node, msg: str):
    path = source_of(node).module_path or "<root>"
    raise MambacPassError(f"propagate_sharding: node '{node.name}' ({_name(node)}) in module '{path}': {msg} "
                          "Replicate this module in the plan (plan={path: 'replicate'}) or add a sharding rule.")


def replicated_only(node, ins, what: str):
    """The documented default for operations without a rule: replicated inputs only (partial
    sums are reduced first; a split input is an error naming the op)."""
    for n, p in ins.items():
        if isinstance(p, Shard):
            _fail(node, f"{what} has no sharding rule and its input '{n.name}' is split ({p}).")
    return R, {n: R for n, p in ins.items() if isinstance(p, Partial)}


# ---- pointwise -------------------------------------------------------------------------------------

def _partial_passes(node, ins) -> bool:
    name = _name(node)
    tensors = [p for p in ins.values() if p is not None]
    parts = [p for p in tensors if isinstance(p, Partial)]
    if name in ("add", "sub") and len(parts) == len(tensors):
        return True
    if name in LINEAR_UNARY and len(tensors) == 1:
        return True
    if name in ("mul", "truediv", "div") and len(parts) == 1 and all(isinstance(p, Replicate) for p in tensors
                                                                        if p is not parts[0]):
        first = node.args[0]
        return name == "mul" or (isinstance(first, torch.fx.Node) and isinstance(ins.get(first), Partial))
    return False


def pointwise(node, ins, st, dim: str):
    out = _val(node)
    if not isinstance(out, torch.Tensor):
        return replicated_only(node, ins, _name(node))
    if any(isinstance(p, Partial) for p in ins.values()) and _partial_passes(node, ins):
        return Partial(), {}
    shards: dict[int, Shard] = {}
    for n, p in ins.items():
        if isinstance(p, Shard):
            off = out.dim() - _val(n).dim()
            shards[p.dim + off] = p.moved(p.dim + off)
    if len(shards) > 1:
        _fail(node, f"inputs are split along different dims {sorted(shards)}.")
    target = next(iter(shards.values())) if shards else R
    wants = {}
    for n, p in ins.items():
        if p is None:
            continue
        v = _val(n)
        off = out.dim() - v.dim()
        if isinstance(p, Partial):
            wants[n] = target.moved(target.dim - off) if isinstance(target, Shard) else R
        elif isinstance(p, Replicate) and isinstance(target, Shard):
            d = target.dim - off
            if d >= 0 and v.shape[d] != 1 and v.shape[d] != out.shape[target.dim]:
                continue
            if d >= 0 and v.shape[d] != 1 and not target.segments:
                wants[n] = Shard(d)  # slice the replicated operand to match
    return target, wants


def embedding(node, ins):
    """A lookup in a replicated table: the result is laid out like the ids (a split table is
    rewritten to ``vocab_parallel_embedding`` first)."""
    ids, table = node.args[0], (node.args[1] if len(node.args) > 1 else None)
    if isinstance(ins.get(table), Shard):
        _fail(node, "looks up a table that is split; use the vocab_embedding plan kind.")
    p = ins.get(ids)
    return (Partial() if isinstance(ins.get(table), Partial) else p), ({ids: R} if isinstance(p, Partial) else {})


# ---- torch.nn modules of a user's model (Linear and Embedding have their own rules) --------------

# parameter-free elementwise modules: a split input stays split along any dim
ELEMENTWISE_MODULES = tuple(getattr(torch.nn, n) for n in (
    "Identity", "Dropout", "ReLU", "ReLU6", "LeakyReLU", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid", "Softplus",
    "ELU", "CELU", "SELU", "Hardswish", "Hardsigmoid", "Hardtanh", "Softsign", "Tanhshrink") if hasattr(torch.nn, n))
SOFTMAX_MODULES = (torch.nn.Softmax, torch.nn.LogSoftmax)
# norms over the trailing ``normalized_shape`` dims, with replicated affine parameters
ROW_NORM_MODULES = tuple(getattr(torch.nn, n) for n in ("LayerNorm", "RMSNorm") if hasattr(torch.nn, n))
# modules that compute each sample (dim 0) alone, with replicated parameters
PER_SAMPLE_MODULES = tuple(getattr(torch.nn, n) for n in (
    "Conv1d", "Conv2d", "Conv3d", "GroupNorm", "InstanceNorm1d", "InstanceNorm2d") if hasattr(torch.nn, n))


def _whole(x, p):
    """Run on the whole input: gathered if split, reduced if partial (output replicated)."""
    return R, ({x: R} if not isinstance(p, Replicate) else {})


def _per_sample(x, p, mod, dim: str):
    """A module that computes each sample alone: on the data-parallel dim the batch split passes
    through (its parameters' gradients are summed over the replicas like every parameter's);
    otherwise it runs on its whole input."""
    if dim == "dp" and isinstance(p, Shard) and p.dim == 0:
        return p, {}
    return _whole(x, p)


def _softmax(x, p, mod, dim: str):
    """Softmax over one dim: a split along any other dim passes through (None: no dim given)."""
    if mod.dim is None:
        return None
    if isinstance(p, Shard) and p.dim != mod.dim % _val(x).dim():
        return p, {}
    return _whole(x, p)


def _elementwise(x, p, mod, dim: str):
    """An elementwise module: its output is laid out like its input (a partial sum passes through
    ``Identity`` only; the others take it reduced)."""
    if isinstance(p, Partial):
        return (Partial(), {}) if isinstance(mod, torch.nn.Identity) else (R, {x: R})
    return p, {}


def _row_norm(x, p, mod, dim: str):
    """A LayerNorm / RMSNorm module: on the data-parallel dim a split outside the normalised dims
    passes through (each sample is normalised alone; the parameters' gradients are summed over the
    replicas like every parameter's).  Otherwise it runs on its whole input: on the tensor-parallel
    dim a split input would leave its parameters with partial gradients."""
    if dim == "dp" and isinstance(p, Shard) and p.dim < _val(x).dim() - len(mod.normalized_shape):
        return p, {}
    return _whole(x, p)


_MODULE_RULES = ((ELEMENTWISE_MODULES, _elementwise), (ROW_NORM_MODULES, _row_norm), (SOFTMAX_MODULES, _softmax),
                 (PER_SAMPLE_MODULES, _per_sample))


def nn_module(node, ins, mod, dim: str):
    """The rule of a torch.nn module of the tables above, applied to its one tensor input (its first
    argument); a module outside them, with other inputs, or that its rule refuses runs replicated
    only (``replicated_only``'s error where its input is not replicated)."""
    x = node.args[0] if node.args else None
    rule = next((r for types, r in _MODULE_RULES if isinstance(mod, types)), None)
    out = rule(x, ins[x], mod, dim) if rule is not None and len(ins) == 1 and x in ins else None
    return out if out is not None else replicated_only(node, ins, f"module {type(mod).__name__}")


# ---- linear ------------------------------------------------------------------------------------

def linear(node, ins, x, wpl, bpl):
    """Column-parallel (weight split on rows), row-parallel (on columns) or replicated linear."""
    out = _val(node)
    last = out.dim() - 1
    xp = ins.get(x)
    if isinstance(wpl, Shard) and wpl.dim == 0:
        return Shard(last, wpl.segments), ({x: R} if not isinstance(xp, Replicate) else {})
    if isinstance(wpl, Shard) and wpl.dim == 1:
        if bpl is not None:
            _fail(node, "a row-parallel linear with a bias must be split into linear + add first.")
        want = Shard(last, wpl.segments)
        return Partial(), ({} if isinstance(xp, Shard) and xp.dim == last else {x: want})
    if isinstance(xp, Shard) and xp.dim != last:
        return xp, {}
    if isinstance(xp, Partial) and bpl is None:
        return Partial(), {}
    return R, ({x: R} if not isinstance(xp, Replicate) else {})


# ---- views -------------------------------------------------------------------------------------

def _scale(segments: tuple[Segment, ...], num: int, den: int, node) -> tuple[Segment, ...]:
    out = []
    for s in segments:
        vals = [s.start * num, s.size * num, s.total * num]
        if any(v % den for v in vals):
            _fail(node, f"a view splits the sharded dim inside segment {s}.")
        out.append(Segment(s.name, *(v // den for v in vals)))
    return tuple(out)


def _view_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """Pair up dims of two shapes with the same element count: [(dims of a, dims of b)].  Size-1
    dims join the group that follows them (trailing ones the last group)."""
    i = j = 0
    groups: list[tuple[list[int], list[int]]] = []
    while i < len(a) or j < len(b):
        gi, gj = [], []
        while i < len(a) and a[i] == 1:
            gi, i = gi + [i], i + 1
        while j < len(b) and b[j] == 1:
            gj, j = gj + [j], j + 1
        if i >= len(a) or j >= len(b):
            gi, gj = gi + list(range(i, len(a))), gj + list(range(j, len(b)))
            i, j = len(a), len(b)
            if groups:
                groups[-1] = (groups[-1][0] + gi, groups[-1][1] + gj)
            else:
                groups.append((gi, gj))
            break
        pa, pb = a[i], b[j]
        gi, gj, i, j = gi + [i], gj + [j], i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa, gi, i = pa * a[i], gi + [i], i + 1
            else:
                pb, gj, j = pb * b[j], gj + [j], j + 1
        groups.append((gi, gj))
    return groups


def view(node, ins, st, dim: str):
    x = node.args[0]
    p = ins.get(x)
    if not isinstance(p, Shard):
        return p, {}
    a, b = tuple(_val(x).shape), tuple(_val(node).shape)
    for gi, gj in _view_groups(a, b):
        if p.dim not in gi:
            continue
        if any(a[k] != 1 for k in gi[:gi.index(p.dim)]) or not gj:
            _fail(node, f"a view reshapes the sharded dim {p.dim} of {a} into {b} in a way a shard cannot follow.")
        num = math.prod(a[p.dim + 1:gi[-1] + 1])
        glob = st.gm.meta.get(GLOBAL_SHAPES, {}).get(node.name)
        for k in gj:  # the output dim that holds the split: the first whose size differs globally
            if glob is not None and len(glob) == len(b) and glob[k] == b[k] and k != gj[-1]:
                continue
            segs = _repeated(p.segments, math.prod(b[gj[0]:k]))
            den = math.prod(b[k + 1:gj[-1] + 1])
            if segs is not None and all((v * num) % den == 0 for s in segs for v in (s.start, s.size, s.total)):
                return Shard(k, _scale(segs, num, den, node)), {}
            if glob is None and b[k] != 1:
                break
        _fail(node, f"a view cuts the sharded dim {p.dim} of {a} into {b} inside a segment.")
    _fail(node, "shard dim not found in view.")


def _repeated(segments: tuple[Segment, ...], copies: int) -> tuple[Segment, ...] | None:
    """The segments of one of ``copies`` identical blocks (a view that moves the split to an inner
    dim, e.g. B as (rank, groups, state) split by group), or None when they are not repeated."""
    if copies == 1:
        return segments
    if not segments or len(segments) % copies:
        return None
    n = len(segments) // copies
    blocks = [tuple((s.start, s.size, s.total) for s in segments[i * n:(i + 1) * n]) for i in range(copies)]
    if any(b != blocks[0] for b in blocks):
        return None
    return tuple(Segment(s.name.rstrip("0123456789") or s.name, s.start, s.size, s.total) for s in segments[:n])


def _dim_arg(node, pos: int, key: str, default=None):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(key, default)


def transpose(node, ins, st, dim: str):
    p = ins.get(node.args[0])
    if not isinstance(p, Shard):
        return p, {}
    nd = _val(node).dim()
    a, b = (d % nd for d in (_dim_arg(node, 1, "dim0"), _dim_arg(node, 2, "dim1")))
    return p.moved({a: b, b: a}.get(p.dim, p.dim)), {}


def permute(node, ins, st, dim: str):
    p = ins.get(node.args[0])
    if not isinstance(p, Shard):
        return p, {}
    dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
    nd = _val(node).dim()
    return p.moved([d % nd for d in dims].index(p.dim)), {}


def unsqueeze(node, ins, st, dim: str):
    p = ins.get(node.args[0])
    if not isinstance(p, Shard):
        return p, {}
    d = _dim_arg(node, 1, "dim") % _val(node).dim()
    return p.moved(p.dim + (1 if d <= p.dim else 0)), {}


def expand(node, ins, st, dim: str):
    """Broadcast; a replicated value expanded inside a split module becomes rank-local (its
    expanded size is a local head count), so consumers see it split and its gradient is reduced."""
    x = node.args[0]
    p = ins.get(x)
    a, b = tuple(_val(x).shape), tuple(_val(node).shape)
    off = len(b) - len(a)
    if isinstance(p, Shard):
        return p.moved(p.dim + off), {}
    grown = [k + off for k in range(len(a)) if a[k] == 1 and b[k + off] != 1]
    if isinstance(p, Replicate) and dim == "tp" and grown and st.in_module(node):
        return Shard(grown[0]), {}
    return p, {}


def split(node, ins, st, dim: str):
    """split/chunk: pieces along the sharded dim take the segments they cover."""
    x = node.args[0]
    p = ins.get(x)
    outs = _val(node)
    if not isinstance(p, Shard):
        return tuple(p for _ in outs), {}
    nd = _val(x).dim()
    d = _dim_arg(node, 2, "dim", 0) % nd
    if d != p.dim:
        return tuple(p for _ in outs), {}
    if not p.segments:
        _fail(node, "splits a dim that is split across ranks evenly (batch or sequence).")
    pieces, segs = [], list(p.segments)
    for o in outs:
        want, got = o.shape[d], []
        while want > 0:
            s = segs.pop(0)
            if s.size > want:
                _fail(node, f"split size {o.shape[d]} cuts through segment {s}.")
            got.append(s)
            want -= s.size
        while segs and segs[0].size == 0:
            got.append(segs.pop(0))
        pieces.append(_piece(got, d))
    return tuple(pieces), {}


def _piece(segs: list[Segment], d: int):
    live = [s for s in segs if s.size or s.total]
    if live and all(s.replicated for s in live):
        return R
    return Shard(d, tuple(segs))


def getitem(node, ins, st, dim: str):
    x, idx = node.args
    p = ins.get(x)
    if not isinstance(p, Shard):
        return p, {}
    idx = idx if isinstance(idx, tuple) else (idx,)
    src = out = 0
    for it in idx:
        if it is Ellipsis:
            skip = _val(x).dim() - sum(1 for k in idx if k is not None and k is not Ellipsis)
            if src <= p.dim < src + skip:
                return p.moved(out + p.dim - src), {}
            src, out = src + skip, out + skip
        elif it is None:
            out += 1
        elif isinstance(it, int):
            if src == p.dim:
                _fail(node, "indexes into the sharded dim.")
            src += 1
        elif isinstance(it, slice):
            if src == p.dim:
                if it != slice(None):
                    _fail(node, "slices the sharded dim.")
                return p.moved(out), {}
            src, out = src + 1, out + 1
        else:
            _fail(node, f"index {it!r} is not supported on a split tensor.")
    return p.moved(out + p.dim - src), {}


def cat(node, ins, st, dim: str):
    tensors = node.args[0]
    d = _dim_arg(node, 1, "dim", 0) % _val(node).dim()
    pls = [ins.get(t) for t in tensors]
    if all(isinstance(q, Replicate) for q in pls):
        return R, {}
    if any(isinstance(q, Partial) for q in pls):
        return R, {t: R for t, q in zip(tensors, pls) if isinstance(q, Partial)}
    shard_dims = {q.dim for q in pls if isinstance(q, Shard)}
    if shard_dims != {d}:
        if len(shard_dims) == 1 and all(isinstance(q, Shard) for q in pls):
            return pls[0], {}
        _fail(node, "concatenates split and replicated tensors along a dim other than the split one.")
    segs: list[Segment] = []
    for t, q in zip(tensors, pls):
        n = _val(t).shape[d]
        hint = t.meta.get(SEGMENTS_HINT) if isinstance(q, Replicate) else None
        segs.extend(q.segments if isinstance(q, Shard) and q.segments else (hint or [Segment(t.name, 0, n, n)]))
    return Shard(d, tuple(segs)), {}


def reduce(node, ins, st, dim: str):
    x = node.args[0]
    p = ins.get(x)
    if not isinstance(p, Shard):
        return p, {}
    nd = _val(x).dim()
    dims = _dim_arg(node, 1, "dim")
    dims = tuple(range(nd)) if dims is None else ((dims,) if isinstance(dims, int) else tuple(dims))
    dims = tuple(k % nd for k in dims)
    if p.dim in dims:
        if _name(node) != "sum":
            _fail(node, "averages over the sharded dim.")
        return Partial(), {}
    keep = _dim_arg(node, 2, "keepdim", False)
    return p.moved(p.dim - (0 if keep else sum(1 for k in dims if k < p.dim))), {}


VIEWS = {"reshape", "view", "unflatten", "flatten", "squeeze"}
SHAPE_RULES = {"transpose": transpose, "permute": permute, "unsqueeze": unsqueeze, "expand": expand,
               "split": split, "chunk": split, "getitem": getitem, "cat": cat, "sum": reduce, "mean": reduce}


def _reduced_first(rule, node, ins, st, dim: str):
    """Shape ops take partial sums reduced (the sum is taken once, where it is produced: one
    all-reduce for Mamba-1's x_proj output rather than one per piece of it)."""
    parts = {n: R for n, p in ins.items() if isinstance(p, Partial)}
    if not parts:
        return rule(node, ins, st, dim)
    out, wants = rule(node, {**ins, **parts}, st, dim)
    return out, {**parts, **wants}


def generic(node, ins, st, dim: str):
    name = _name(node)
    if name == "embedding":
        return embedding(node, ins)
    if name in VIEWS:
        return _reduced_first(view, node, ins, st, dim)
    if name in SHAPE_RULES:
        return _reduced_first(SHAPE_RULES[name], node, ins, st, dim)
    if name in POINTWISE:
        return pointwise(node, ins, st, dim)
    if node.target in (pops.ce_sum, pops.token_count) or node.target is pops.vocab_parallel_ce_sum:
        return _loss_part(node, ins, dim)
    return replicated_only(node, ins, name)


def _loss_part(node, ins, dim: str):
    """Sums over the tokens: Partial over dp when the batch is split, Replicate over tp."""
    batch = any(isinstance(p, Shard) for p in ins.values())
    if dim == "tp" and node.target is not pops.vocab_parallel_ce_sum and batch:
        return replicated_only(node, ins, _name(node))
    return (Partial() if (dim == "dp" and batch) else R), {}


# ---- mambac ops (channel-parallel) ----------------------------------------------------------------

def _args(node) -> dict:
    info = info_for_target(node.target)
    return {name: node.args[i] for i, name in enumerate(info.arg_names) if i < len(node.args)}


def _is_tensor(n) -> bool:
    return isinstance(n, torch.fx.Node) and isinstance(_val(n), torch.Tensor)


def channel_op(node, ins, name: str, rule, st, dim: str):
    args = {a: n for a, n in _args(node).items() if _is_tensor(n) and a in rule.args}
    specs = {a: rule.args[a] for a in args}
    outputs = list(rule.outputs)
    if name == "gated_rmsnorm" and _norm_rowwise(ins, args):
        specs = {a: (ArgSpec() if a == "weight" else ArgSpec(rowwise=True)) for a in args}
    if name == "mamba3_mimo" and _args(node).get("mimo_o") is None:
        outputs[0] = ArgSpec(batch=0, channel=3)
    pl, wants = {}, {}
    for a, n in args.items():
        p = ins.get(n)
        if isinstance(p, Partial):
            p = st_stream(st, n) if specs[a].rowwise else R
            wants[n] = p
        pl[a] = p
    if any(s.rowwise for s in specs.values()):
        outs, wants = _rowwise(node, args, specs, pl, wants, len(outputs))
    else:
        outs, wants = _channel(node, args, specs, pl, wants, outputs)
    return (outs[0] if len(outs) == 1 else outs), wants


def _norm_rowwise(ins, args) -> bool:
    """A grouped norm whose input is split along a dim other than the normalised one."""
    p = ins.get(args["x"])
    return isinstance(p, Shard) and p.dim != _val(args["x"]).dim() - 1


def st_stream(st, n):
    """Where a Partial value is reduced in front of a norm: the sequence under sequence parallelism."""
    if st.mesh.sequence_parallel and _val(n).dim() >= 3:
        return Shard(1)
    return R


def _rowwise(node, args, specs, pl, wants, n_out):
    nd = {a: _val(n).dim() for a, n in args.items()}
    dims = {p.dim - nd[a] for a, p in pl.items() if isinstance(p, Shard)}  # from the end
    if len(dims) > 1:
        _fail(node, "its inputs are split along different dims.")
    if not dims:
        return (R,) * n_out, wants
    d = dims.pop()
    if d == -1:
        _fail(node, "normalises over a dim that is split across ranks.")
    lead = next(p for p in pl.values() if isinstance(p, Shard))
    for a, n in args.items():
        if specs[a].rowwise and isinstance(pl[a], Replicate):
            wants[n] = Shard(nd[a] + d)
    return (lead.moved(nd["x"] + d),) * n_out, wants


def _norm(d: int, nd: int) -> int:
    return d % nd


def _channel(node, args, specs, pl, wants, outputs):
    nd = {a: _val(n).dim() for a, n in args.items()}
    on_chan = [a for a, p in pl.items() if isinstance(p, Shard) and specs[a].channel is not None
               and p.dim == _norm(specs[a].channel, nd[a])]
    on_batch = [a for a, p in pl.items() if isinstance(p, Shard) and specs[a].batch is not None
                and p.dim == specs[a].batch]
    for a, p in pl.items():  # any other split (e.g. the sequence) is gathered first
        if isinstance(p, Shard) and a not in on_chan and a not in on_batch:
            wants[args[a]], pl[a] = R, R
    if on_chan:
        lead = pl[on_chan[0]]
        for a, s in specs.items():
            if a in on_chan or (s.group and isinstance(pl[a], Replicate)):
                continue
            if s.channel is not None:
                _fail(node, f"argument '{a}' is {pl[a]} while the heads are split; the plan must split it too.")
            if not isinstance(pl[a], Replicate):
                wants[args[a]] = R
        return tuple(Shard(_norm(o.channel, _val(node)[i].dim() if isinstance(_val(node), tuple)
                                 else _val(node).dim()), lead.segments) for i, o in enumerate(outputs)), wants
    if on_batch:
        for a, s in specs.items():
            if s.batch is not None and isinstance(pl[a], Replicate):
                wants[args[a]] = Shard(s.batch)
        return tuple(Shard(o.batch) for o in outputs), wants
    return tuple(R for _ in outputs), wants
