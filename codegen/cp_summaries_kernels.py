"""Fused kernels for the SSD context-parallel summaries (``runtime.context_parallel.ssd_summaries``).

A cp rank needs the inclusive cumulative log-decay ``cum_t = sum_{s<=t} A * dt'_s`` of its piece
(dt' = clamp(softplus(dt + dt_bias))): its last step is the piece's total decay (the summary that
travels with the final state) and every step scales the output correction.  In PyTorch that is
four elementwise launches and a cumsum along the sequence, which is not the contiguous dim of the
(b, l, h) layout.  Here one forward launch per (batch, block of heads) walks the sequence in tiles
of (steps x heads) -- the whole piece in one tile up to 1024 steps -- applying the prologue and
carrying the running sum between tiles.  One backward launch walks it from the end: the reverse
cumsum of dcum gives d(A dt'), then the prologue's backward gives ddt, and each program writes its
(batch, heads) partial sums of dA and dbias (summed over the batch afterwards, in a fixed order).

Everything is computed in fp32; ``cum`` is fp32 (as the PyTorch path's ``ct`` for half inputs).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_STEPS = 1024
TILE = 8192


@triton.jit
def _softplus(v):
    """softplus with torch's threshold (identity above 20) and an accurate log1p below it."""
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(v > 20.0, v, lp)


@triton.jit
def _program_heads(A, BIAS, H, HAS_BIAS: tl.constexpr, BH: tl.constexpr):
    """This program's batch row and block of heads, with their A and dt_bias (zero without one)."""
    bb = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = hs < H
    a = tl.load(A + hs, mask=hm, other=0.0).to(tl.float32)
    bias = tl.zeros((BH,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(BIAS + hs, mask=hm, other=0.0).to(tl.float32)
    return bb, hs, hm, a, bias


@triton.jit
def _load_dt(DT, bb, sd_b, sd_l, ls, hs, m, bias, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr):
    """A (steps x heads) tile of dt + dt_bias in fp32, before and after the softplus."""
    v = tl.load(DT + bb * sd_b + ls[:, None] * sd_l + hs[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        v = v + bias[None, :]
    d = v
    if SOFTPLUS:
        d = _softplus(v)
    return v, d


@triton.jit
def _cum_fwd(DT, BIAS, A, CUM, L, H, sd_b, sd_l, sc_b, sc_l, dt_min, dt_max,
             HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
             BL: tl.constexpr, BH: tl.constexpr):
    bb, hs, hm, a, bias = _program_heads(A, BIAS, H, HAS_BIAS, BH)
    carry = tl.zeros((BH,), dtype=tl.float32)
    for l0 in range(0, L, BL):
        ls = l0 + tl.arange(0, BL)
        m = (ls[:, None] < L) & hm[None, :]
        v, d = _load_dt(DT, bb, sd_b, sd_l, ls, hs, m, bias, HAS_BIAS, SOFTPLUS)
        if CLAMP:
            d = tl.minimum(tl.maximum(d, dt_min), dt_max)
        da = tl.where(m, d * a[None, :], 0.0)
        c = tl.cumsum(da, 0) + carry[None, :]
        tl.store(CUM + bb * sc_b + ls[:, None] * sc_l + hs[None, :], c, mask=m)
        carry = carry + tl.sum(da, 0)


@triton.jit
def _cum_bwd(DCUM, DT, BIAS, A, DDT, DA, DBIAS, L, H, sg_b, sg_l, sd_b, sd_l, so_b, so_l, dt_min, dt_max,
             HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr, CLAMP: tl.constexpr,
             BL: tl.constexpr, BH: tl.constexpr):
    bb, hs, hm, a, bias = _program_heads(A, BIAS, H, HAS_BIAS, BH)
    carry = tl.zeros((BH,), dtype=tl.float32)   # sum of dcum over the steps after this tile
    da_acc = tl.zeros((BH,), dtype=tl.float32)
    db_acc = tl.zeros((BH,), dtype=tl.float32)
    n_tiles = tl.cdiv(L, BL)
    for i in range(0, n_tiles):
        l0 = (n_tiles - 1 - i) * BL
        ls = l0 + tl.arange(0, BL)
        m = (ls[:, None] < L) & hm[None, :]
        g = tl.load(DCUM + bb * sg_b + ls[:, None] * sg_l + hs[None, :], mask=m, other=0.0).to(tl.float32)
        dda = tl.cumsum(g, 0, reverse=True) + carry[None, :]       # d(A dt') of every step
        carry = carry + tl.sum(g, 0)
        v, d = _load_dt(DT, bb, sd_b, sd_l, ls, hs, m, bias, HAS_BIAS, SOFTPLUS)
        grad = dda * a[None, :]
        if CLAMP:
            grad = tl.where((d >= dt_min) & (d <= dt_max), grad, 0.0)   # torch's inclusive rule
            d = tl.minimum(tl.maximum(d, dt_min), dt_max)
        if SOFTPLUS:
            grad = tl.where(v > 20.0, grad, grad * tl.sigmoid(v))
        grad = tl.where(m, grad, 0.0)
        da_acc += tl.sum(tl.where(m, dda * d, 0.0), 0)
        db_acc += tl.sum(grad, 0)
        tl.store(DDT + bb * so_b + ls[:, None] * so_l + hs[None, :], grad, mask=m)
    tl.store(DA + bb * H + hs, da_acc, mask=hm)
    if HAS_BIAS:
        tl.store(DBIAS + bb * H + hs, db_acc, mask=hm)


def _last_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tiles(l: int, h: int) -> tuple[int, int]:
    """(steps, heads) of one tile: the whole length in one tile up to 1024 steps (the walk along
    the sequence is then one load, one cumsum and one store), about 8K numbers per tile."""
    bl = min(MAX_STEPS, max(16, triton.next_power_of_2(l)))
    bh = max(2, min(32, TILE // bl, triton.next_power_of_2(h)))
    return bl, bh


def _flags(dt_bias: Optional[Tensor], softplus: bool, dt_min: float, dt_max: float) -> dict:
    return dict(HAS_BIAS=dt_bias is not None, SOFTPLUS=bool(softplus),
                CLAMP=(dt_min, dt_max) != (0.0, math.inf))


def summaries_forward(dt: Tensor, A: Tensor, dt_bias: Optional[Tensor], softplus: bool, dt_min: float,
                      dt_max: float) -> Tensor:
    """cum (b, l, h) fp32: the inclusive cumulative sum over l of A * clamp(softplus(dt + dt_bias))."""
    b, l, h = dt.shape
    dt = _last_unit(dt)
    cum = torch.empty(b, l, h, device=dt.device, dtype=torch.float32)
    bl, bh = _tiles(l, h)
    bias = dt_bias.contiguous() if dt_bias is not None else A
    _cum_fwd[(b, triton.cdiv(h, bh))](
        dt, bias, A.contiguous(), cum, l, h, dt.stride(0), dt.stride(1), cum.stride(0), cum.stride(1),
        float(dt_min), float(min(dt_max, 3.0e38)), **_flags(dt_bias, softplus, dt_min, dt_max),
        BL=bl, BH=bh, num_warps=8 if bl * bh >= 4096 else 4)
    return cum


def summaries_backward(dcum: Tensor, dt: Tensor, A: Tensor, dt_bias: Optional[Tensor], softplus: bool,
                       dt_min: float, dt_max: float) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(ddt, dA, ddt_bias) of ``summaries_forward`` (ddt_bias None without a bias)."""
    b, l, h = dt.shape
    dt, dcum = _last_unit(dt), _last_unit(dcum)
    ddt = torch.empty(b, l, h, device=dt.device, dtype=dt.dtype)
    da = torch.empty(b, h, device=dt.device, dtype=torch.float32)
    db = torch.empty(b, h, device=dt.device, dtype=torch.float32) if dt_bias is not None else da
    bl, bh = _tiles(l, h)
    bias = dt_bias.contiguous() if dt_bias is not None else A
    _cum_bwd[(b, triton.cdiv(h, bh))](
        dcum, dt, bias, A.contiguous(), ddt, da, db, l, h, dcum.stride(0), dcum.stride(1), dt.stride(0),
        dt.stride(1), ddt.stride(0), ddt.stride(1), float(dt_min), float(min(dt_max, 3.0e38)),
        **_flags(dt_bias, softplus, dt_min, dt_max), BL=bl, BH=bh, num_warps=8 if bl * bh >= 4096 else 4)
    dbias = db.sum(0).to(dt_bias.dtype) if dt_bias is not None else None
    return ddt, da.sum(0).to(A.dtype), dbias


def supported(dt: Tensor, A: Tensor, dt_bias: Optional[Tensor]) -> bool:
    """Whether the fused kernels take these inputs (else the PyTorch path runs): real (not fake or
    meta) fp32/bf16/fp16 tensors, dt (b, l, h), A and dt_bias (h,)."""
    tensors = [t for t in (dt, A, dt_bias) if t is not None]
    if any(type(t) not in (Tensor, torch.nn.Parameter) or t.device.type == "meta" for t in tensors):
        return False
    ok = all(t.dtype in DTYPES for t in tensors) and dt.dim() == 3 and dt.numel() > 0
    return ok and A.shape == (dt.shape[2],) and (dt_bias is None or dt_bias.shape == (dt.shape[2],))


class SummariesFn(torch.autograd.Function):
    """Autograd wrapper of the fused forward and backward kernels."""

    @staticmethod
    def forward(ctx, dt: Tensor, A: Tensor, dt_bias: Optional[Tensor], softplus: bool, dt_min: float,
                dt_max: float) -> Tensor:
        ctx.save_for_backward(dt, A, dt_bias)
        ctx.prologue = (softplus, dt_min, dt_max)
        return summaries_forward(dt, A, dt_bias, softplus, dt_min, dt_max)

    @staticmethod
    def backward(ctx, dcum: Tensor):
        dt, A, dt_bias = ctx.saved_tensors
        ddt, dA, dbias = summaries_backward(dcum, dt, A, dt_bias, *ctx.prologue)
        return ddt, dA, dbias, None, None, None


def fused_summaries(dt: Tensor, A: Tensor, dt_bias: Optional[Tensor], softplus: bool, dt_min: float,
                    dt_max: float) -> Tensor:
    """``ssd_summaries`` through the fused kernels (autograd included)."""
    return SummariesFn.apply(dt, A, dt_bias, softplus, dt_min, dt_max)
