"""Rank-local forms of layers whose tensor-parallel version is not the same op on local shards.

Passes put these functions into per-rank graphs as single ``call_function`` nodes (they are plain
PyTorch plus ``torch.ops.mambac`` collectives, so fake-tensor shape propagation runs them too):

- ``vocab_parallel_embedding``: a lookup in this rank's vocabulary rows; ids outside them give
  zeros, so the result is a Partial sum over the tensor-parallel ranks.
- ``vocab_parallel_ce_sum``: the summed cross-entropy of logits split over the vocabulary, without
  gathering them (a max and two sums cross the ranks, each one number per token).
- ``ce_sum`` / ``token_count``: the loss as a sum and a count, so a mean over data-parallel ranks
  is exact whatever ``ignore_index`` removes.
- ``select_groups``: the B/C groups a rank's heads read, when B and C are replicated.
- ``group_sumsq`` / ``apply_group_rmsnorm``: a grouped RMSNorm whose groups straddle ranks, as a
  per-group partial sum of squares (all-reduced in the graph) and its application.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import mambac.runtime.collectives  # noqa: F401  (registers torch.ops.mambac collectives)
from mambac.runtime.collectives import _c10d, _run


@torch.library.custom_op("mambac::all_reduce_max", mutates_args=())
def all_reduce_max(x: Tensor, rank: int, world: int, group: str) -> Tensor:
    """Element-wise max over the group (no gradient: used for a numerically safe shift only)."""
    return _run("all_reduce(max)", group, rank,
                lambda: _c10d().wait_tensor(_c10d().all_reduce(x.contiguous(), "max", group)))


@all_reduce_max.register_fake
def _(x, rank, world, group):
    return torch.empty_like(x)


def vocab_parallel_embedding(ids: Tensor, weight: Tensor, start: int) -> Tensor:
    """Rows ``[start, start + weight.shape[0])`` of the embedding; other ids give zero vectors."""
    local = ids - start
    inside = (local >= 0) & (local < weight.shape[0])
    out = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    return out * inside.unsqueeze(-1).to(out.dtype)


def vocab_parallel_ce_sum(logits: Tensor, labels: Tensor, start: int, ignore_index: int, rank: int, world: int,
                          group: str) -> Tensor:
    """Sum over tokens of cross-entropy, logits (N, V_local) holding vocabulary ``[start, start+V_local)``.

    log-sum-exp and the target logit are summed across ranks with ``mambac.all_reduce`` (gradient:
    identity), so each rank's gradient lands on its own vocabulary slice only."""
    x = logits.float()
    shift = torch.ops.mambac.all_reduce_max(x.detach().amax(-1), rank, world, group)
    x = x - shift.unsqueeze(-1)
    sumexp = torch.ops.mambac.all_reduce(x.exp().sum(-1), rank, world, group)
    local = labels - start
    hit = (local >= 0) & (local < x.shape[-1]) & (labels != ignore_index)
    target = x.gather(-1, local.clamp(0, x.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * hit.to(x.dtype)
    target = torch.ops.mambac.all_reduce(target, rank, world, group)
    valid = (labels != ignore_index).to(x.dtype)
    return ((sumexp.log() - target) * valid).sum()


def ce_sum(logits: Tensor, labels: Tensor, ignore_index: int) -> Tensor:
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def token_count(labels: Tensor, ignore_index: int) -> Tensor:
    return (labels != ignore_index).sum().to(torch.float32)


def select_groups(t: Tensor, dim: int, groups: tuple[int, ...]) -> Tensor:
    """``t`` indexed along ``dim`` by ``groups`` (the groups this rank's heads read)."""
    return t.index_select(dim, torch.tensor(groups, device=t.device))


def _ct(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def group_sumsq(x: Tensor, z: Tensor | None, groups: tuple[int, ...], ngroups: int, group_size: int,
                norm_before_gate: bool) -> Tensor:
    """Per global group, this rank's part of mean(h**2) (h the gated input): (..., ngroups)."""
    h = x.to(_ct(x))
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(h.dtype))
    onehot = F.one_hot(torch.tensor(groups, device=x.device), ngroups).to(h.dtype)   # (local, G)
    return (h * h) @ onehot / group_size


def apply_group_rmsnorm(x: Tensor, weight: Tensor, z: Tensor | None, sumsq: Tensor, groups: tuple[int, ...],
                        eps: float, norm_before_gate: bool) -> Tensor:
    """Normalise each local channel by its group's (all-reduced) mean square, then weight and gate."""
    h = x.to(_ct(x))
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(h.dtype))
    scale = torch.rsqrt(sumsq + eps).index_select(-1, torch.tensor(groups, device=x.device))
    out = h * scale * weight.to(h.dtype)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(h.dtype))
    return out.to(x.dtype)
