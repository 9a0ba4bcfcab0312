"""Training helpers that see through sharding.

``clip_grad_norm_`` on a sharded compiled module computes the norm the single-device model would
have: each rank adds the squares of the gradient entries it *owns* (its split parts; replicated
parts only on tp rank 0, so nothing is counted twice), one all-reduce over the tp ranks sums them,
and every rank scales its gradients by the same factor.  Data-parallel replicas hold identical
(already reduced) gradients and need no communication.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def _owned_grads(compiled) -> list[torch.Tensor]:
    setup, tp_rank = compiled.rank_setup, compiled.mesh.spec.tp_rank
    out = []
    for name, p in setup.model.named_parameters():
        if p.grad is None:
            continue
        layout = setup.plan.layout_of(name)
        if layout is None:
            if tp_rank == 0:
                out.append(p.grad)
            continue
        idx = torch.tensor(layout.owned_index(tp_rank), dtype=torch.long, device=p.grad.device)
        out.append(p.grad.index_select(layout.dim, idx))
    return out


def _local_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max().double() for g in grads if g.numel()]).max()
    return sum(g.detach().double().pow(norm_type).sum() for g in grads)


def clip_grad_norm_(module_or_params: torch.nn.Module | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients to ``max_norm`` by their total norm and return that norm.

    For a compiled module with tp > 1 the norm is the unsharded model's (a collective: every rank
    calls it); otherwise this is ``torch.nn.utils.clip_grad_norm_``."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        from mambac.errors import MambacInputError
        raise MambacInputError(f"max_norm must be a positive number, got {max_norm!r} (a negative one would flip "
                               "the gradients' sign).")
    compiled = module_or_params
    sharded = getattr(compiled, "rank_setup", None) is not None and getattr(compiled, "mesh", None) is not None
    if not sharded:
        params = compiled.parameters() if isinstance(compiled, torch.nn.Module) else compiled
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)
    norm_type = float(norm_type)
    local = _local_norm(_owned_grads(compiled), norm_type)
    group = compiled.mesh.tp_group
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    device = next((p.grad.device for p in compiled.parameters() if p.grad is not None), torch.device("cpu"))
    total = local.to(device).reshape(1)
    dist.all_reduce(total, op=op, group=group)
    total = total[0] if norm_type == float("inf") else total[0].pow(1.0 / norm_type)
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in compiled.parameters():
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total.float()
