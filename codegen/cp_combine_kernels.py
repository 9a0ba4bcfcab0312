"""The exchange's two small kernels of the context-parallel SSD (``runtime.cp_ssd_fused``): the
incoming state from the gathered summaries (forward) and the later ranks' final-state gradient from
the gathered incoming-state gradients (backward).  Neither touches the per-chunk states' values in
memory: the kernels that read those states take the fold as a second dot
(``render_common.fold_dot``).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from mambac.codegen.autotune import interpreting


# A rank's piece is first scanned from a zero state (the walk or the per-chunk states and their
# passing, as for the plain SSD), and the state entering chunk c is linear in the incoming state:
# sin_c = sin0_c + exp(P_c) S_in, F = F0 + exp(T) S_in, with P_c = tot_0 + ... + tot_{c-1} and T
# the sum of all chunk totals (tot_c: the last entry of chunk c's dA cumsum).  ``incoming_state``
# forms S_in from the gathered rows, the weights exp(P_c) and F; the forward's chunk scan adds
# exp(P_c) C S_in to each state's part of y and keeps the summed states for the backward.
# Likewise in the backward the gradient of the state leaving chunk c is linear in the final
# state's gradient: adding dF_ext (what later ranks send back) adds exp(tot_{c+1} + ... +
# tot_{nc-1}) dF_ext to it, whose dots dx and dB add to their own, and exp(tot_c) <sin_c, that> to
# the chunk's total-decay gradient, which dC's launch sums since it reads every sin_c anyway
# (``ssd_kernels_bwd.run_dbc``'s part).  The weights are sums of decays, never differences.


@triton.jit
def _store_rounded(ptr, v, mask, EMULATE_BF16: tl.constexpr):
    """Store fp32 ``v`` in ``ptr``'s dtype; EMULATE_BF16: round to nearest even by hand into bf16
    (the interpreter's cast truncates; the generated kernels' ``_to_bf16``, from
    ``render_common.emit_to_bf16``, does the same)."""
    if EMULATE_BF16:
        u = v.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        tl.store(ptr, u.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


def _emulate_bf16(dtype: torch.dtype) -> bool:
    return interpreting() and dtype == torch.bfloat16


@triton.jit
def _chunk_totals(CS, row, c, lo, hi, Q: tl.constexpr):
    """The total log-decays of chunks ``c`` (a vector), 0 outside lo <= c < hi."""
    return tl.load(CS + row + c * Q + Q - 1, mask=(c >= lo) & (c < hi), other=0.0)


@triton.jit
def _incoming(G, CS, F0, FS, FINAL, FW, TOTALS, RANK, WORLD, NC, H, PN, HPN, sg_j, sg_b, sf_b,
              Q: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr, WP: tl.constexpr,
              EMULATE_BF16: tl.constexpr, HAS_FINAL: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bi = bh // H
    h = bh % H
    nb = tl.num_programs(1) // H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    # this piece's own final state first: a load after the stores below would wait for them
    # (HAS_FINAL false: nothing reads the final state, neither it nor F0 is touched)
    if HAS_FINAL:
        f0 = tl.load(F0 + bi * sf_b + h * PN + offs, mask=mask, other=0.0)
    # every rank's total decay T_j, kept (W, b, h) for the backward by one tile of each head
    j = tl.arange(0, WP)
    rows = G + j.to(tl.int64) * sg_j + bi * sg_b
    tl.store(TOTALS + (j * nb + bi) * H + h, tl.load(rows + HPN + h, mask=j < WORLD, other=0.0),
             mask=(j < WORLD) & (j * 0 + pid == 0))
    # S_in = sum_{j < RANK} exp(T_{j+1} + ... + T_{RANK-1}) F0_j: the weights a reverse scan of
    # the totals shifted by one (sums only), the earlier ranks' rows in one 2-D load
    later = tl.cumsum(tl.load(rows + sg_j + HPN + h, mask=j + 1 < RANK, other=0.0), 0, reverse=True)
    f = tl.load(rows[:, None] + h * PN + offs[None, :], mask=(j < RANK)[:, None] & mask[None, :], other=0.0)
    s_in = tl.sum(tl.exp(later)[:, None] * f, 0)
    _store_rounded(FS + bh * PN + offs, s_in, mask, EMULATE_BF16)
    # the weights exp(P_c), P_c = tot_0 + ... + tot_{c-1}: CB chunks at a time, each block's
    # exclusive prefix as a scan of its totals shifted by one (sums only, no differences)
    cs_row = bh * NC * Q
    ci = tl.arange(0, CB)
    before = tl.zeros([], dtype=tl.float32)
    for c0 in range(0, NC, CB):
        c = c0 + ci
        prefix = before + tl.cumsum(_chunk_totals(CS, cs_row, c - 1, c0, NC, Q), 0)
        # (pid == 0 widened to a vector: under the interpreter pid is a plain int)
        tl.store(FW + bh * NC + c, tl.exp(prefix), mask=(c < NC) & (c * 0 + pid == 0))
        before += tl.sum(_chunk_totals(CS, cs_row, c, c0, NC, Q), 0)
    if HAS_FINAL:
        tl.store(FINAL + bh * PN + offs, f0 + tl.exp(before) * s_in, mask=mask)


def _chunk_block(nc: int) -> int:
    """How many chunks the exchange kernels take at once (a power of two, at most 8)."""
    return min(8, triton.next_power_of_2(max(nc, 1)))


def _ranks_block(world: int) -> int:
    """The exchange kernels' rank axis: a power of two holding every rank."""
    return max(2, triton.next_power_of_2(world))


# per kernel: elements of a state per program, and warps.  On an H200 at S1 split in 4
# (`bench_cp.py`), 2048 x 4 cut the worst rank's extra from 44.4 to 43.2 µs against 1024 x 4
# (512 to 4096 elements and 2 to 8 warps tried).  The interpreter's block is smaller: fewer,
# cheaper steps.
LAUNCH = {"incoming": (2048, 4), "outgoing": (2048, 4)}


def _launch(kernel: str) -> tuple[int, int]:
    return (256, 4) if interpreting() else LAUNCH[kernel]


def incoming_state(gathered: Tensor, rank: int, cs: Tensor, f0: Tensor, chunk: int,
                   dtype: torch.dtype, final: bool = True) -> tuple[Tensor, Optional[Tensor], Tensor, Tensor]:
    """The incoming state of a piece scanned from zero: (S_in (b, h, p, n) in ``dtype``, the
    piece's final state from S_in (b, h, p, n) fp32, or None without ``final`` (``f0`` is then
    not read), the weights exp(P_c) (b, h, nc) fp32, every
    rank's total log-decay (W, b, h) fp32), so that the state entering chunk c is its zero-start
    state plus exp(P_c) S_in.  ``gathered`` (W, b, >= h*p*n + h) fp32: every rank's final state
    from zero then its total log-decay, in rank order; ``cs`` (b, h, nc*chunk) fp32, the dA cumsum
    restarting at every chunk; ``f0`` this piece's final state from zero (dense but for its batch
    stride: it may be this rank's row of the summaries).  S_in is the exclusive prefix combine of
    ranks 0 .. rank-1."""
    b, h = f0.shape[0], f0.shape[1]
    pn = f0[0, 0].numel()
    nc = cs.shape[-1] // chunk
    world = gathered.shape[0]
    fs = torch.empty(f0.shape, device=f0.device, dtype=dtype)
    # without ``final`` the kernel's FINAL pointer is a placeholder it never writes through
    out = torch.empty(f0.shape, device=f0.device, dtype=torch.float32) if final else fs
    fw = torch.empty(b, h, nc, device=f0.device, dtype=torch.float32)
    totals = torch.empty(world, b, h, device=f0.device, dtype=torch.float32)
    if gathered.stride(-1) != 1:
        gathered = gathered.contiguous()
    if final and not f0[0].is_contiguous():       # any batch stride; dense within a batch
        f0 = f0.contiguous()
    block, warps = _launch("incoming")
    _incoming[(triton.cdiv(pn, block), b * h)](
        gathered, cs, f0, fs, out, fw, totals, rank, world, nc, h, pn, h * pn, gathered.stride(0),
        gathered.stride(1), f0.stride(0), Q=chunk, BLOCK=block, CB=_chunk_block(nc), WP=_ranks_block(world),
        EMULATE_BF16=_emulate_bf16(dtype), HAS_FINAL=final, num_warps=warps)
    return fs, out if final else None, fw, totals


@triton.jit
def _outgoing(E, TOT, CS, GS, FW, RANK, WORLD, NC, H, PN, se_j, se_b,
              Q: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr, WP: tl.constexpr,
              EMULATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bi = bh // H
    h = bh % H
    nb = tl.num_programs(1) // H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    # dF_ext = sum_{r > RANK} exp(T_{RANK+1} + ... + T_{r-1}) dS_in(r): the weights a scan of the
    # totals shifted by one (sums only), the later ranks' rows in one 2-D load
    r = tl.arange(0, WP)
    between = tl.cumsum(tl.load(TOT + ((r - 1) * nb + bi) * H + h, mask=(r - 1 > RANK) & (r - 1 < WORLD),
                                other=0.0), 0)
    e = tl.load(E + r.to(tl.int64)[:, None] * se_j + bi * se_b + h * PN + offs[None, :],
                mask=((r > RANK) & (r < WORLD))[:, None] & mask[None, :], other=0.0)
    _store_rounded(GS + bh * PN + offs, tl.sum(tl.exp(between)[:, None] * e, 0), mask, EMULATE_BF16)
    # per chunk c, the weight exp(tot_{c+1} + ... + tot_{nc-1}) (one tile of each head): CB chunks
    # at a time from the last block back, each block's exclusive suffix as a reverse scan of its
    # totals shifted by one (sums only)
    if pid == 0:
        cs_row = bh * NC * Q
        ci = tl.arange(0, CB)
        after = tl.zeros([], dtype=tl.float32)
        for bb in range(0, tl.cdiv(NC, CB)):
            c0 = (tl.cdiv(NC, CB) - 1 - bb) * CB
            c = c0 + ci
            hi = tl.minimum(c0 + CB, NC)
            w = tl.exp(after + tl.cumsum(_chunk_totals(CS, cs_row, c + 1, c0, hi, Q), 0, reverse=True))
            tl.store(FW + bh * NC + c, w, mask=c < NC)
            after += tl.sum(_chunk_totals(CS, cs_row, c, c0, NC, Q), 0)


def outgoing_gradient(every: Tensor, totals: Tensor, rank: int, cs: Tensor, state_shape: tuple, chunk: int,
                      dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The later ranks' gradient of this piece's final state, dF_ext: (dF_ext (b, h, p, n) in
    ``dtype``, the weights exp(tot_{c+1} + ... + tot_{nc-1}) (b, h, nc) fp32 with which it adds to
    the gradient of the state leaving chunk c).  ``every`` (W, b, >= h*p*n) fp32: every rank's
    incoming-state gradient in rank order; ``totals`` (W, b, h) fp32 every rank's total log-decay
    (contiguous); ``state_shape`` (b, h, p, n); ``cs`` as for ``incoming_state``.  What dF_ext adds
    to the chunks' total-decay gradients dC's launch forms (``run_dbc``'s ``part``), since it
    reads the per-chunk states anyway."""
    world = every.shape[0]
    b, h = state_shape[0], state_shape[1]
    pn = int(torch.Size(state_shape[2:]).numel())
    nc = cs.shape[-1] // chunk
    gs = torch.empty(state_shape, device=cs.device, dtype=dtype)
    fw = torch.empty(b, h, nc, device=cs.device, dtype=torch.float32)
    if every.stride(-1) != 1:
        every = every.contiguous()
    block, warps = _launch("outgoing")
    _outgoing[(triton.cdiv(pn, block), b * h)](every, totals, cs, gs, fw, rank, world, nc, h, pn,
                                                 every.stride(0), every.stride(1), Q=chunk, BLOCK=block,
                                                 CB=_chunk_block(nc), WP=_ranks_block(world),
                                                 EMULATE_BF16=_emulate_bf16(dtype), num_warps=warps)
    return gs, fw
