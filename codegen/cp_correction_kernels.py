"""Fused kernels for the SSD context-parallel correction (``runtime.context_parallel.ssd_correction``).

A rank that scanned its piece from a zero state gets the true output as
``y = (y0 + exp(cum_t) * C_t S_in) * silu(z)`` (gate optional), with ``S_in`` (b, h, p, n) the
incoming state.  One forward launch per (span of L, head, batch) does the (BL x n) @ (n x p)
matmul, the row scale, the add and the gate in registers; y0, z and C are read once and y written
once.  One backward launch per (block of L, heads of one group, batch) recomputes the correction,
writes dy0 (= dy without z), dz and dcum, sums dC over its heads in registers and adds it with one
fp32 atomic per element; a second launch per (head, span of L, batch) sums dS_in over its steps in
registers (one add per program, so few atomics; their order, and the sums' last bits, may vary).

Matmul operands are cast to the input dtype for bf16/fp16 (fp32 accumulation) and run in IEEE
fp32 for fp32 inputs.  Tiles are picked by ``autotune.choose`` among a few configs on CUDA.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from mambac.codegen import autotune
from mambac.codegen.kernel_ir import TileConfig

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_VERSION = "v3"


@triton.jit
def _cast(x, REF, DOT: tl.constexpr):
    """A matmul operand: fp32 for fp32 inputs (DOT 0), else rounded to the inputs' half dtype."""
    if DOT == 0:
        return x.to(tl.float32)
    else:
        return x.to(REF.dtype.element_ty)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """tl.dot in IEEE fp32 (DOT 0), on half operands (DOT 1), or on half values widened to fp32
    (DOT 2: the interpreter multiplies half operands wrongly)."""
    if DOT == 1:
        return tl.dot(a, b)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _cp_corr_fwd(Y0, C, CUM, S, Z, Y, L, P, N, HPG,
                 sy_b, sy_l, sy_h, sc_b, sc_l, sc_g, sm_b, sm_l, sm_h, sz_b, sz_l, sz_h,
                 so_b, so_l, so_h,
                 HAS_Z: tl.constexpr, DOT: tl.constexpr,
                 BL: tl.constexpr, SPAN: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """One program: SPAN steps (SPAN // BL blocks) of one head; the head's state is loaded once."""
    pid_l = tl.program_id(0)
    hh = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    H = tl.num_programs(1)
    gg = hh // HPG
    op = tl.arange(0, BP)
    on = tl.arange(0, BN)
    mp = op < P
    mn = on < N
    s = tl.load(S + (bb * H + hh) * P * N + op[:, None] * N + on[None, :],
                mask=mp[:, None] & mn[None, :], other=0.0)
    st = tl.trans(_cast(s, Y0, DOT))
    for j in range(0, SPAN, BL):
        ol = pid_l * SPAN + j + tl.arange(0, BL)
        ml = ol < L
        c = tl.load(C + bb * sc_b + gg * sc_g + ol[:, None] * sc_l + on[None, :],
                    mask=ml[:, None] & mn[None, :], other=0.0)
        corr = _dot(_cast(c, Y0, DOT), st, DOT)
        cum = tl.load(CUM + bb * sm_b + ol * sm_l + hh * sm_h, mask=ml, other=0.0).to(tl.float32)
        m2 = ml[:, None] & mp[None, :]
        y0 = tl.load(Y0 + bb * sy_b + hh * sy_h + ol[:, None] * sy_l + op[None, :], mask=m2, other=0.0)
        y = y0.to(tl.float32) + corr * tl.exp(cum)[:, None]
        if HAS_Z:
            z = tl.load(Z + bb * sz_b + hh * sz_h + ol[:, None] * sz_l + op[None, :], mask=m2, other=0.0)
            z = z.to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        tl.store(Y + bb * so_b + hh * so_h + ol[:, None] * so_l + op[None, :], y.to(Y.dtype.element_ty),
                 mask=m2)


@triton.jit
def _cp_corr_bwd(DY, Y0, C, CUM, S, Z, DY0, DZ, DCUM, DC, L, P, N, H, HPG,
                 sd_b, sd_l, sd_h, sy_b, sy_l, sy_h, sc_b, sc_l, sc_g, sm_b, sm_l, sm_h,
                 sz_b, sz_l, sz_h,
                 HAS_Z: tl.constexpr, DOT: tl.constexpr, HB: tl.constexpr,
                 BL: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """dy0/dz (b, l, h, p; written only with z) and dcum (b, l, h) contiguous; dC (b, l, g, n) fp32,
    zeroed, accumulated atomically (one add per program: its heads are summed in registers)."""
    pid_l = tl.program_id(0)
    h0 = tl.program_id(1) * HB
    bb = tl.program_id(2).to(tl.int64)
    gg = h0 // HPG
    ol = pid_l * BL + tl.arange(0, BL)
    op = tl.arange(0, BP)
    on = tl.arange(0, BN)
    ml = ol < L
    mp = op < P
    mn = on < N
    mc = ml[:, None] & mn[None, :]
    ms = mp[:, None] & mn[None, :]
    m2 = ml[:, None] & mp[None, :]
    c = tl.load(C + bb * sc_b + gg * sc_g + ol[:, None] * sc_l + on[None, :], mask=mc, other=0.0)
    c = _cast(c, Y0, DOT)
    dc = tl.zeros((BL, BN), dtype=tl.float32)
    for i in range(HB):
        hh = h0 + i
        s = tl.load(S + (bb * H + hh) * P * N + op[:, None] * N + on[None, :], mask=ms, other=0.0)
        s = _cast(s, Y0, DOT)
        corr = _dot(c, tl.trans(s), DOT)
        e = tl.exp(tl.load(CUM + bb * sm_b + ol * sm_l + hh * sm_h, mask=ml, other=0.0).to(tl.float32))
        dy = tl.load(DY + bb * sd_b + hh * sd_h + ol[:, None] * sd_l + op[None, :], mask=m2, other=0.0)
        dy = dy.to(tl.float32)
        out = bb * L * H * P + hh * P + ol[:, None] * (H * P) + op[None, :]
        if HAS_Z:
            z = tl.load(Z + bb * sz_b + hh * sz_h + ol[:, None] * sz_l + op[None, :], mask=m2, other=0.0)
            z = z.to(tl.float32)
            y0 = tl.load(Y0 + bb * sy_b + hh * sy_h + ol[:, None] * sy_l + op[None, :], mask=m2, other=0.0)
            sig = tl.sigmoid(z)
            ypre = y0.to(tl.float32) + corr * e[:, None]
            dpre = dy * (z * sig)
            dz = dy * ypre * (sig * (1.0 + z * (1.0 - sig)))
            tl.store(DZ + out, dz.to(DZ.dtype.element_ty), mask=m2)
            tl.store(DY0 + out, dpre.to(DY0.dtype.element_ty), mask=m2)
        else:
            dpre = dy   # dy0 is dy itself
        dcum = e * tl.sum(dpre * corr, axis=1)
        tl.store(DCUM + bb * L * H + ol * H + hh, dcum, mask=ml)
        w = _cast(dpre * e[:, None], Y0, DOT)
        dc += _dot(w, s, DOT)
    G = H // HPG
    tl.atomic_add(DC + bb * L * G * N + gg * N + ol[:, None] * (G * N) + on[None, :], dc, mask=mc,
                  sem="relaxed")


@triton.jit
def _cp_corr_ds(DP, Y0, C, CUM, DS, L, P, N, H, HPG,
                sp_b, sp_l, sp_h, sc_b, sc_l, sc_g, sm_b, sm_l, sm_h,
                DOT: tl.constexpr, BL: tl.constexpr, SPAN: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    """dS_in (b, h, p, n) fp32 = sum over steps of (exp(cum) * dpre)^T C: one program per (head,
    span of L, batch) keeps its (p, n) sum in registers and adds it once (zeroed output).  ``DP`` is
    the gradient before the gate (dy0: dy * silu(z) with a gate, dy itself without)."""
    hh = tl.program_id(0)
    pid_s = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    gg = hh // HPG
    op = tl.arange(0, BP)
    on = tl.arange(0, BN)
    mp = op < P
    mn = on < N
    acc = tl.zeros((BP, BN), dtype=tl.float32)
    for j in range(0, SPAN, BL):
        ol = pid_s * SPAN + j + tl.arange(0, BL)
        ml = ol < L
        dp = tl.load(DP + bb * sp_b + hh * sp_h + ol[:, None] * sp_l + op[None, :],
                     mask=ml[:, None] & mp[None, :], other=0.0).to(tl.float32)
        e = tl.exp(tl.load(CUM + bb * sm_b + ol * sm_l + hh * sm_h, mask=ml, other=0.0).to(tl.float32))
        c = tl.load(C + bb * sc_b + gg * sc_g + ol[:, None] * sc_l + on[None, :],
                    mask=ml[:, None] & mn[None, :], other=0.0)
        w = _cast(dp * e[:, None], Y0, DOT)
        acc += _dot(tl.trans(w), _cast(c, Y0, DOT), DOT)
    tl.atomic_add(DS + (bb * H + hh) * P * N + op[:, None] * N + on[None, :], acc,
                  mask=mp[:, None] & mn[None, :], sem="relaxed")


def _dot_mode(y0: Tensor) -> int:
    if y0.dtype == torch.float32:
        return 0
    return 2 if autotune.interpreting() else 1


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _last_unit(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd_candidates(p: int, n: int, l: int) -> list[TileConfig]:
    """block_m: steps per tile; block_k: steps per program (the head's state loaded once)."""
    if autotune.interpreting() or not torch.cuda.is_available():
        return [TileConfig(block_m=16, block_k=32, num_warps=1, num_stages=1)]
    big = _pow2(p) * _pow2(n) > 64 * 128
    tiles = ((32, 4), (64, 8), (16, 4)) if big else ((64, 4), (128, 8), (32, 4), (64, 8))
    cands = []
    for bl, w in tiles:
        for span in (bl, 4 * bl):
            if span == bl or span < l:
                cands.append(TileConfig(block_m=bl, block_k=span, num_warps=w, num_stages=2))
    return cands


def _bwd_candidates(p: int, n: int, hpg: int) -> list[TileConfig]:
    """block_m: steps per program; heads: heads of one group per program (dC summed in registers)."""
    if autotune.interpreting() or not torch.cuda.is_available():
        heads = max(d for d in (1, 2) if hpg % d == 0)
        return [TileConfig(block_m=16, heads=heads, num_warps=1, num_stages=1)]
    divs = [d for d in (8, 4, 2, 1) if hpg % d == 0]
    big = _pow2(p) * _pow2(n) > 64 * 128
    blocks = ((32, 4), (16, 4)) if big else ((64, 8), (32, 4), (64, 4), (128, 8))   # (steps, warps)
    return [TileConfig(block_m=bl, heads=hb, num_warps=w, num_stages=st)
            for bl, w in blocks for hb in divs[:3] for st in (1, 2)]


def _ds_candidates(b: int, h: int, l: int) -> list[TileConfig]:
    """block_m: steps per tile; block_k: steps per program (the whole length when b * h programs
    fill the device, else a few spans whose sums are added)."""
    if autotune.interpreting() or not torch.cuda.is_available():
        return [TileConfig(block_m=16, block_k=32, num_warps=1, num_stages=1)]
    cands = []
    for bl, w in ((64, 4), (32, 4), (64, 8)):
        whole = triton.cdiv(l, bl) * bl
        for span in {whole, max(bl, triton.cdiv(triton.cdiv(l, 4), bl) * bl)}:
            cands.append(TileConfig(block_m=bl, block_k=span, num_warps=w, num_stages=2))
    return cands


def _choose(name: str, dims: tuple[int, ...], cands: list[TileConfig], launch) -> TileConfig:
    bucket = autotune.bucket_key(*dims)
    return autotune.choose(f"cp_correction_{name}_{_VERSION}", bucket, cands,
                           lambda cfg: autotune.time_ms(lambda: launch(cfg)))


def correction_forward(y0: Tensor, C: Tensor, cum: Tensor, s_in: Tensor, z: Optional[Tensor]) -> Tensor:
    """y = (y0 + exp(cum) * (C @ S_in^T per head)) * silu(z), in y0's dtype."""
    b, l, h, p = y0.shape
    g, n = C.shape[2], C.shape[3]
    y0, C, cum = _last_unit(y0), _last_unit(C), cum
    z = None if z is None else _last_unit(z)
    s = s_in.contiguous()
    y = torch.empty(b, l, h, p, device=y0.device, dtype=y0.dtype)
    zz = z if z is not None else y0
    dot = _dot_mode(y0)

    def launch(cfg: TileConfig) -> None:
        _cp_corr_fwd[(triton.cdiv(l, cfg.block_k), h, b)](
            y0, C, cum, s, zz, y, l, p, n, h // g,
            y0.stride(0), y0.stride(1), y0.stride(2), C.stride(0), C.stride(1), C.stride(2),
            cum.stride(0), cum.stride(1), cum.stride(2), zz.stride(0), zz.stride(1), zz.stride(2),
            y.stride(0), y.stride(1), y.stride(2),
            HAS_Z=z is not None, DOT=dot, BL=cfg.block_m, SPAN=cfg.block_k, BP=_pow2(p), BN=_pow2(n),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    cfg = _choose("fwd", (b, l, h, p, n, int(z is not None)), _fwd_candidates(p, n, l), launch)
    launch(cfg)
    return y


def correction_backward(dy: Tensor, y0: Tensor, C: Tensor, cum: Tensor, s_in: Tensor,
                        z: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(dy0, dC, dcum, ds_in, dz) of ``correction_forward`` (dz None without z)."""
    b, l, h, p = y0.shape
    g, n = C.shape[2], C.shape[3]
    hpg = h // g
    dy, y0, C = _last_unit(dy), _last_unit(y0), _last_unit(C)
    z = None if z is None else _last_unit(z)
    s = s_in.contiguous()
    zz = z if z is not None else y0
    dev = y0.device
    dy0 = torch.empty(b, l, h, p, device=dev, dtype=y0.dtype) if z is not None else dy.to(y0.dtype)
    dz = torch.empty(b, l, h, p, device=dev, dtype=z.dtype) if z is not None else dy0
    dcum = torch.empty(b, l, h, device=dev, dtype=torch.float32)
    dot = _dot_mode(y0)

    def launch(cfg: TileConfig) -> Tensor:
        dc = torch.zeros(b, l, g, n, device=dev, dtype=torch.float32)
        _cp_corr_bwd[(triton.cdiv(l, cfg.block_m), h // cfg.heads, b)](
            dy, y0, C, cum, s, zz, dy0, dz, dcum, dc, l, p, n, h, hpg,
            dy.stride(0), dy.stride(1), dy.stride(2), y0.stride(0), y0.stride(1), y0.stride(2),
            C.stride(0), C.stride(1), C.stride(2), cum.stride(0), cum.stride(1), cum.stride(2),
            zz.stride(0), zz.stride(1), zz.stride(2),
            HAS_Z=z is not None, DOT=dot, HB=cfg.heads, BL=cfg.block_m, BP=_pow2(p), BN=_pow2(n),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return dc

    cfg = _choose("bwd", (b, l, h, p, n, g, int(z is not None)), _bwd_candidates(p, n, hpg), launch)
    dc = launch(cfg)
    dpre = dy0 if z is not None else dy        # the gradient before the gate

    def launch_ds(cfg: TileConfig) -> Tensor:
        ds = torch.zeros(b, h, p, n, device=dev, dtype=torch.float32)
        _cp_corr_ds[(h, triton.cdiv(l, cfg.block_k), b)](
            dpre, y0, C, cum, ds, l, p, n, h, hpg,
            dpre.stride(0), dpre.stride(1), dpre.stride(2), C.stride(0), C.stride(1), C.stride(2),
            cum.stride(0), cum.stride(1), cum.stride(2),
            DOT=dot, BL=cfg.block_m, SPAN=cfg.block_k, BP=_pow2(p), BN=_pow2(n),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return ds

    cfg = _choose("ds", (b, l, h, p, n, g), _ds_candidates(b, h, l), launch_ds)
    ds = launch_ds(cfg)
    return (dy0, dc.to(C.dtype), dcum.to(cum.dtype), ds.to(s_in.dtype),
            dz if z is not None else None)


def supported(y0: Tensor, C: Tensor, cum: Tensor, s_in: Tensor, z: Optional[Tensor]) -> bool:
    """Whether the fused kernels take these inputs (else the PyTorch path runs): real tensors (not
    fake or meta ones, as in shape propagation) of fp32/bf16/fp16."""
    tensors = [t for t in (y0, C, cum, s_in, z) if t is not None]
    if any(type(t) not in (Tensor, torch.nn.Parameter) or t.device.type == "meta" for t in tensors):
        return False
    ok = y0.dtype in DTYPES and C.dtype in DTYPES and s_in.dtype in DTYPES and cum.dtype in DTYPES
    ok = ok and (z is None or (z.dtype in DTYPES and z.shape == y0.shape))
    ok = ok and y0.dim() == 4 and C.dim() == 4 and cum.dim() == 3 and s_in.dim() == 4
    return ok and y0.numel() > 0 and C.shape[2] > 0 and y0.shape[2] % C.shape[2] == 0


class CorrectionFn(torch.autograd.Function):
    """Autograd wrapper of the fused forward and backward kernels."""

    @staticmethod
    def forward(ctx, y0: Tensor, C: Tensor, cum: Tensor, s_in: Tensor, z: Optional[Tensor]) -> Tensor:
        ctx.save_for_backward(y0, C, cum, s_in, z)
        return correction_forward(y0, C, cum, s_in, z)

    @staticmethod
    def backward(ctx, dy: Tensor):
        y0, C, cum, s_in, z = ctx.saved_tensors
        dy0, dC, dcum, ds, dz = correction_backward(dy, y0, C, cum, s_in, z)
        return dy0, dC, dcum, ds, dz


def fused_correction(y0: Tensor, C: Tensor, cum: Tensor, s_in: Tensor, z: Optional[Tensor]) -> Tensor:
    """``ssd_correction`` through the fused kernels (autograd included)."""
    return CorrectionFn.apply(y0, C, cum, s_in, z)
