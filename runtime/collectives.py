"""The collectives that lowered per-rank programs call: ``torch.ops.mambac.<name>`` custom ops.

Each op runs a ``torch.distributed`` functional collective (``torch.ops._c10d_functional``: gloo on
CPU, NCCL on GPU) over the process group named by its ``group`` argument, has a fake (shape-only)
implementation so passes can place it in graphs without any process group, and an autograd rule
that follows the Megatron SPMD convention: a Replicate value carries the same, whole gradient on
every rank, a Shard value the gradient of its slice, a Partial value the whole gradient.  Hence

    all_reduce        Partial -> Replicate   forward: sum            backward: identity
    grad_all_reduce   Replicate -> (used by a sharded op)  forward: identity   backward: sum
    all_gather        Shard -> Replicate     forward: gather         backward: this rank's slice
    all_gather_rs     all_gather fused with grad_all_reduce: backward reduce-scatter (sequence parallel)
    shard_slice       Replicate -> Shard     forward: this rank's slice   backward: gather
    reduce_scatter    Partial -> Shard       forward: reduce-scatter  backward: gather

Shards along a dimension are even with the first ranks taking one more (``split_sizes``); the
gathered size ``full`` is an argument because it cannot be recovered from one rank's slice.  The
rank and world size are arguments too: every rank runs its own lowered program.  A failing
collective raises ``MambacRuntimeError`` naming the op, the rank, the group and the cause.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mambac.errors import MambacRuntimeError


def split_sizes(n: int, parts: int) -> list[int]:
    """``n`` entries over ``parts`` ranks, the first ``n % parts`` ranks taking one more."""
    return [n // parts + (1 if r < n % parts else 0) for r in range(parts)]


def split_start(n: int, parts: int, rank: int) -> int:
    return sum(split_sizes(n, parts)[:rank])


def _c10d():
    return torch.ops._c10d_functional


def _run(what: str, group: str, rank: int, fn):
    """Run one collective; any failure (peer gone, timeout) becomes a clear error."""
    try:
        return fn()
    except MambacRuntimeError:
        raise
    except Exception as exc:  # gloo/NCCL raise RuntimeError/DistBackendError with terse text
        import torch.distributed as dist
        me = dist.get_rank() if dist.is_initialized() else rank
        text = str(exc).strip().splitlines()
        raise MambacRuntimeError(
            f"collective {what} on rank {me} (rank {rank} of group '{group}') failed: {type(exc).__name__}: "
            f"{text[0] if text else ''}. {_missing_ranks(me)}Another rank has probably died or stopped calling the "
            "model, or the process-group timeout expired; check the other ranks' logs.") from exc


_FAILURES = [0]  # failures seen by this process: alive ranks that fail together share the count


def _missing_ranks(rank: int, wait_s: float = 2.0) -> str:
    """Best effort: every rank whose collective failed checks in through the process group's
    store; the ranks that have not checked in after ``wait_s`` are the ones that died or hung."""
    import time

    import torch.distributed as dist
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        tag = f"mambac/failure{_FAILURES[0]}"
        _FAILURES[0] += 1
        store.set(f"{tag}/{rank}", "1")
        deadline = time.monotonic() + wait_s
        missing = list(range(world))
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([f"{tag}/{r}"])]
            time.sleep(0.05)
        return f"Ranks that did not reach this point within {wait_s:.0f}s: {missing}. " if missing else ""
    except Exception:  # the store lives on rank 0; if that rank is gone there is nobody to ask
        return ""


def _gather(x: Tensor, dim: int, full: int, rank: int, world: int, group: str) -> Tensor:
    sizes = split_sizes(full, world)
    pad = max(sizes) - x.shape[dim]
    xt = x.movedim(dim, 0).contiguous()
    if pad:
        xt = torch.cat([xt, xt.new_zeros(pad, *xt.shape[1:])])
    out = _run("all_gather", group, rank, lambda: _c10d().wait_tensor(
        _c10d().all_gather_into_tensor(xt, world, group)))
    pieces = out.split(max(sizes))
    return torch.cat([p[:s] for p, s in zip(pieces, sizes)]).movedim(0, dim)


def _slice(x: Tensor, dim: int, rank: int, world: int) -> Tensor:
    n = x.shape[dim]
    return x.narrow(dim, split_start(n, world, rank), split_sizes(n, world)[rank])


def _reduce_scatter(x: Tensor, dim: int, rank: int, world: int, group: str) -> Tensor:
    sizes = split_sizes(x.shape[dim], world)
    width = max(sizes)
    xt = x.movedim(dim, 0)
    chunks = []
    for piece, s in zip(xt.split(sizes), sizes):
        chunks.append(piece if s == width else torch.cat([piece, piece.new_zeros(width - s, *piece.shape[1:])]))
    flat = torch.cat(chunks).contiguous()
    out = _run("reduce_scatter", group, rank, lambda: _c10d().wait_tensor(
        _c10d().reduce_scatter_tensor(flat, "sum", world, group)))
    return out[:sizes[rank]].movedim(0, dim).contiguous()


def _local_shape(shape, dim: int, rank: int, world: int) -> list[int]:
    out = list(shape)
    out[dim] = split_sizes(shape[dim], world)[rank]
    return out


# ---- all_reduce: Partial -> Replicate ---------------------------------------------------------

@torch.library.custom_op("mambac::all_reduce", mutates_args=())
def all_reduce(x: Tensor, rank: int, world: int, group: str) -> Tensor:
    return _run("all_reduce", group, rank,
                lambda: _c10d().wait_tensor(_c10d().all_reduce(x.contiguous(), "sum", group)))


@all_reduce.register_fake
def _(x, rank, world, group):
    return torch.empty_like(x)


def _identity_backward(ctx, g):
    return g, None, None, None


all_reduce.register_autograd(_identity_backward)


# ---- grad_all_reduce: identity forward, sum of gradients backward -------------------------------

@torch.library.custom_op("mambac::grad_all_reduce", mutates_args=())
def grad_all_reduce(x: Tensor, rank: int, world: int, group: str) -> Tensor:
    return x.clone()


@grad_all_reduce.register_fake
def _(x, rank, world, group):
    return torch.empty_like(x)


def _setup_group(ctx, inputs, output):
    ctx.rank, ctx.world, ctx.group = inputs[-3], inputs[-2], inputs[-1]


def _sum_backward(ctx, g):
    return torch.ops.mambac.all_reduce(g, ctx.rank, ctx.world, ctx.group), None, None, None


grad_all_reduce.register_autograd(_sum_backward, setup_context=_setup_group)


# ---- all_gather: Shard(dim) -> Replicate --------------------------------------------------------

@torch.library.custom_op("mambac::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, full: int, rank: int, world: int, group: str) -> Tensor:
    return _gather(x, dim, full, rank, world, group)


@all_gather.register_fake
def _(x, dim, full, rank, world, group):
    shape = list(x.shape)
    shape[dim] = full
    return x.new_empty(shape)


def _setup_dim(ctx, inputs, output):
    ctx.dim = inputs[1]
    _setup_group(ctx, inputs, output)


def _gather_backward(ctx, g):
    return torch.ops.mambac.shard_slice(g, ctx.dim, ctx.rank, ctx.world, ctx.group), None, None, None, None, None


all_gather.register_autograd(_gather_backward, setup_context=_setup_dim)


# ---- all_gather_rs: gather forward, reduce-scatter backward (sequence parallel entry) -----------

@torch.library.custom_op("mambac::all_gather_rs", mutates_args=())
def all_gather_rs(x: Tensor, dim: int, full: int, rank: int, world: int, group: str) -> Tensor:
    return _gather(x, dim, full, rank, world, group)


@all_gather_rs.register_fake
def _(x, dim, full, rank, world, group):
    shape = list(x.shape)
    shape[dim] = full
    return x.new_empty(shape)


def _gather_rs_backward(ctx, g):
    return (torch.ops.mambac.reduce_scatter(g, ctx.dim, ctx.rank, ctx.world, ctx.group),
            None, None, None, None, None)


all_gather_rs.register_autograd(_gather_rs_backward, setup_context=_setup_dim)


# ---- shard_slice: Replicate -> Shard(dim) -------------------------------------------------------

@torch.library.custom_op("mambac::shard_slice", mutates_args=())
def shard_slice(x: Tensor, dim: int, rank: int, world: int, group: str) -> Tensor:
    return _slice(x, dim, rank, world).clone(memory_format=torch.contiguous_format)


@shard_slice.register_fake
def _(x, dim, rank, world, group):
    return x.new_empty(_local_shape(x.shape, dim, rank, world))


def _setup_slice(ctx, inputs, output):
    ctx.full = inputs[0].shape[inputs[1]]
    _setup_dim(ctx, inputs, output)


def _slice_backward(ctx, g):
    return torch.ops.mambac.all_gather(g, ctx.dim, ctx.full, ctx.rank, ctx.world, ctx.group), None, None, None, None


shard_slice.register_autograd(_slice_backward, setup_context=_setup_slice)


# ---- reduce_scatter: Partial -> Shard(dim) ------------------------------------------------------

@torch.library.custom_op("mambac::reduce_scatter", mutates_args=())
def reduce_scatter(x: Tensor, dim: int, rank: int, world: int, group: str) -> Tensor:
    return _reduce_scatter(x, dim, rank, world, group)


@reduce_scatter.register_fake
def _(x, dim, rank, world, group):
    return x.new_empty(_local_shape(x.shape, dim, rank, world))


reduce_scatter.register_autograd(_slice_backward, setup_context=_setup_slice)

COLLECTIVES = ("all_reduce", "grad_all_reduce", "all_gather", "all_gather_rs", "shard_slice", "reduce_scatter")
FORWARD_COMM = {"all_reduce": "all_reduce", "all_gather": "all_gather", "all_gather_rs": "all_gather",
                "reduce_scatter": "reduce_scatter"}


def collective_name(node) -> str | None:
    """The collective a graph node calls (``'all_reduce'``, ...), or None."""
    target = getattr(node, "target", None)
    packet = getattr(target, "overloadpacket", target)
    for name in COLLECTIVES:
        if packet is getattr(torch.ops.mambac, name):
            return name
    return None
