"""Checkpoint I/O for sharded compiled modules.

- ``full_state_dict`` / ``load_full_state_dict``: unsharded state dicts, the same keys and tensors as
  the original model's (``CompiledModule.state_dict``/``load_state_dict`` call these).  Gathering
  is a collective over the tp ranks: every rank calls it.
- ``save_sharded`` / ``load_sharded``: ``torch.distributed.checkpoint`` with each rank writing only
  what it owns (replicated parts once); every parameter is stored as its unsharded logical tensor,
  so a checkpoint saved at one tp/dp loads at another (resharding).
- ``check_same_inputs``: the debug-mode check that every rank was given the same batch.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mambac.errors import MambacInputError, MambacRuntimeError


def _require_mesh(compiled):
    if compiled.mesh is None:
        from mambac.runtime.mesh import launch_hint
        raise MambacRuntimeError("sharded state needs the process group the module was compiled under; "
                                 + launch_hint(compiled.options.world_size) + ".")
    return compiled.mesh


def rank_plans(compiled) -> list:
    """The plan of every tp rank (layouts only, no tensors), cached on the module."""
    cache = compiled.__dict__.setdefault("_mambac_rank_plans", None)
    if cache is None:
        from mambac.sharding_plan import make_plan, param_layouts_by_id
        opts, model = compiled.options, compiled.original_module
        cache = []
        for r in range(opts.tp):
            p = make_plan(model, opts.tp, r, dict(opts.plan))
            param_layouts_by_id(model, p)
            cache.append(p)
        compiled.__dict__["_mambac_rank_plans"] = cache
    return cache


def _gather_param(key: str, local: torch.Tensor, plans: list, mesh) -> torch.Tensor:
    layouts = [p.layout_of(key) for p in plans]
    dim = layouts[0].dim
    sizes = [sum(s.size for s in lay.segments) for lay in layouts]
    pad = max(sizes) - local.shape[dim]
    padded = local.detach()
    if pad:
        shape = list(local.shape)
        shape[dim] = pad
        padded = torch.cat([padded, padded.new_zeros(shape)], dim)
    pieces = [torch.empty_like(padded) for _ in layouts]
    dist.all_gather(pieces, padded.contiguous(), group=mesh.tp_group)
    shape = list(local.shape)
    shape[dim] = sum(s.total for s in layouts[0].segments)
    full = local.new_empty(shape)
    for lay, piece, n in zip(layouts, pieces, sizes):
        idx = torch.tensor(lay.global_index(), device=full.device, dtype=torch.long)
        full.index_copy_(dim, idx, piece.narrow(dim, 0, n))
    return full


def full_state_dict(compiled) -> dict[str, torch.Tensor]:
    """The unsharded state dict of a sharded compiled module (collective over the tp ranks)."""
    mesh = _require_mesh(compiled)
    setup, plans = compiled.rank_setup, rank_plans(compiled)
    out = {}
    for key, value in setup.model.state_dict().items():
        if setup.plan.layout_of(key) is None:
            out[key] = value.detach().clone()
        else:
            out[key] = _gather_param(key, value, plans, mesh)
    return out


def load_full_state_dict(compiled, state_dict: dict[str, Any], strict: bool = True):
    """Copy this rank's shards of an unsharded ``state_dict`` into the module (no communication)."""
    setup = compiled.rank_setup
    local = setup.model.state_dict(keep_vars=True)
    missing = [k for k in local if k not in state_dict]
    unexpected = [k for k in state_dict if k not in local]
    if strict and (missing or unexpected):
        raise MambacInputError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}.")
    with torch.no_grad():
        for key, target in local.items():
            if key not in state_dict:
                continue
            layout = setup.plan.layout_of(key)
            src = state_dict[key]
            piece = src if layout is None else layout.local(src)
            if piece.shape != target.shape:
                raise MambacInputError(f"'{key}': the unsharded tensor has shape {tuple(src.shape)}, which does not "
                                       f"give this rank's shard shape {tuple(target.shape)}.")
            target.copy_(piece)
    from torch.nn.modules.module import _IncompatibleKeys
    return _IncompatibleKeys(missing, unexpected)


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1).to(torch.float64)
    w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) / max(1, x.numel())
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device), x.sum(), (x * w).sum()])


def check_same_inputs(values: list[Any], rank: int) -> None:
    """Debug mode: raise naming the ranks whose inputs differ from rank 0's (every rank must pass
    the same full batch)."""
    prints = [_fingerprint(v) for v in values if isinstance(v, torch.Tensor)]
    if not prints:
        return
    mine = torch.stack(prints)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    from mambac.runtime.collectives import _run
    _run("all_gather (MAMBAC_DEBUG input check)", "world", rank, lambda: dist.all_gather(everyone, mine))
    bad = [r for r, theirs in enumerate(everyone) if not torch.equal(theirs, everyone[0])]
    if bad:
        raise MambacInputError(f"MAMBAC_DEBUG: ranks {bad} were given inputs that differ from rank 0's (seen on rank "
                               f"{rank}); every rank must pass the same full batch to a compiled module.")


def _segment_offsets(layout) -> list[int]:
    out, offset = [], 0
    for s in layout.segments:
        out.append(offset)
        offset += s.total
    return out


def _sharded_entry(key: str, local: torch.Tensor, layout, mesh):
    """A ShardedTensor of the unsharded parameter holding the pieces this rank owns (its split
    segments on dp rank 0; replicated segments on tp rank 0 of dp rank 0 only)."""
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
    spec = mesh.spec
    shards, pos = [], 0
    for seg, base in zip(layout.segments, _segment_offsets(layout)):
        mine = spec.dp_rank == 0 and spec.cp_rank == 0 and (not seg.replicated or spec.tp_rank == 0)
        if mine and seg.size:
            offsets = [0] * local.dim()
            offsets[layout.dim] = base + seg.start
            piece = local.detach().narrow(layout.dim, pos, seg.size).contiguous()
            shards.append(Shard.from_tensor_and_offsets(piece, offsets, dist.get_rank()))
        pos += seg.size
    shape = list(local.shape)
    shape[layout.dim] = sum(s.total for s in layout.segments)
    return init_from_local_shards(shards, *shape)


def save_sharded(compiled, path: str) -> None:
    """Save with ``torch.distributed.checkpoint``: each rank writes only what it owns; every
    entry is the unsharded tensor, so any tp/dp layout can load it (collective)."""
    import torch.distributed.checkpoint as dcp
    mesh = _require_mesh(compiled)
    setup = compiled.rank_setup
    state = {}
    for key, value in setup.model.state_dict().items():
        layout = setup.plan.layout_of(key)
        state[key] = value.detach() if layout is None else _sharded_entry(key, value, layout, mesh)
    dcp.save(state, checkpoint_id=path)


def load_sharded(compiled, path: str) -> None:
    """Load a ``save_sharded`` checkpoint written at any tp/dp: every rank reads the unsharded
    tensors and keeps its own shards (collective)."""
    import torch.distributed.checkpoint as dcp
    _require_mesh(compiled)
    full = {k: torch.empty_like(v, device="cpu") for k, v in compiled.original_module.state_dict().items()}
    dcp.load(full, checkpoint_id=path)
    load_full_state_dict(compiled, full)
