"""The exchange's folds of the context-parallel SSD (``runtime.cp_ssd_fused``): the incoming state
into a piece's per-chunk states (forward) and the later ranks' final-state gradient into its
per-chunk state gradients (backward), each one launch that also forms the weighted sum over the
gathered ranks it needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mambac.codegen.autotune import interpreting


# The exchange's two folds.  A rank's piece is first scanned from a zero state (the walk or the
# per-chunk states and their passing, as for the plain SSD), and the state entering chunk c is
# linear in the incoming state: sin_c = sin0_c + exp(P_c) S_in, F = F0 + exp(T) S_in, with
# P_c = tot_0 + ... + tot_{c-1} and T the sum of all chunk totals (tot_c: the last entry of
# chunk c's dA cumsum).  Likewise in the backward the gradient of the state leaving chunk c is
# linear in the final state's gradient: adding dF_ext (what later ranks send back) adds
# exp(tot_{c+1} + ... + tot_{nc-1}) dF_ext to it, and exp(tot_c) <sin_c, that> to the chunk's
# total-decay gradient.  Each fold is one launch that forms the rank sum (S_in or dF_ext) from
# the gathered rows, its weights from the gathered total decays (sums of decays, never
# differences), and writes every chunk's state: it reads and writes the per-chunk states once,
# where a second walk or state pass would read x and B (dy and C) again.  The zero-start states
# come in fp32 (the region's ``fp32_states``) so that the result is rounded to the io dtype once.


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
def _chunk_total(CS, row, c, Q: tl.constexpr):
    return tl.load(CS + row + c * Q + Q - 1)


@triton.jit
def _fold_incoming(G, CS, SIN0, SIN, F0, FINAL, RANK, NC, H, PN, HPN, sg_j, sg_b, Q: tl.constexpr,
                   BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bi = bh // H
    h = bh % H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    # S_in = sum_{j < RANK} exp(T_{j+1} + ... + T_{RANK-1}) F0_j, from the last earlier rank back
    s_in = tl.zeros([BLOCK], dtype=tl.float32)
    later = tl.zeros([], dtype=tl.float32)
    for jj in range(0, RANK):
        j = RANK - 1 - jj
        row = G + j * sg_j + bi * sg_b
        s_in += tl.exp(later) * tl.load(row + h * PN + offs, mask=mask, other=0.0)
        later += tl.load(row + HPN + h)
    cs_row = bh * NC * Q
    before = tl.zeros([], dtype=tl.float32)
    for c in range(0, NC):
        at = ((bi * NC + c) * H + h) * PN + offs
        s = tl.load(SIN0 + at, mask=mask, other=0.0).to(tl.float32) + tl.exp(before) * s_in
        _store_rounded(SIN + at, s, mask, EMULATE_BF16)
        before += _chunk_total(CS, cs_row, c, Q)
    f0 = tl.load(F0 + bh * PN + offs, mask=mask, other=0.0)
    tl.store(FINAL + bh * PN + offs, f0 + tl.exp(before) * s_in, mask=mask)


def fold_incoming_state(gathered: Tensor, rank: int, cs: Tensor, sin0: Tensor, f0: Tensor, chunk: int,
                        dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Give a piece scanned from zero its incoming state: from ``sin0`` (b, nc, h, p, n), the
    states entering its chunks from zero (fp32, so that they are rounded once), the states from
    S_in in ``dtype``, and the final state from S_in, (b, h, p, n) fp32.  ``gathered`` (W, b,
    >= h*p*n + h) fp32: every rank's final state from zero then its total log-decay, in rank
    order; ``cs`` (b, h, nc*chunk) fp32, the dA cumsum restarting at every chunk; ``f0`` this
    piece's final state from zero.  S_in is the exclusive prefix combine of ranks 0 .. rank-1."""
    b, nc, h = sin0.shape[0], sin0.shape[1], sin0.shape[2]
    pn = sin0[0, 0, 0].numel()
    sin = torch.empty(sin0.shape, device=sin0.device, dtype=dtype)
    final = torch.empty(b, h, *sin0.shape[3:], device=sin0.device, dtype=torch.float32)
    if gathered.stride(-1) != 1:
        gathered = gathered.contiguous()
    block = 256 if interpreting() else 1024
    _fold_incoming[(triton.cdiv(pn, block), b * h)](
        gathered, cs, sin0, sin, f0.contiguous(), final, rank, nc, h, pn, h * pn, gathered.stride(0),
        gathered.stride(1), Q=chunk, BLOCK=block, EMULATE_BF16=_emulate_bf16(dtype), num_warps=4)
    return sin, final


@triton.jit
def _fold_outgoing(E, TOT, CS, SIN, DSOUT0, DSOUT, PARTS, RANK, WORLD, NC, H, PN, se_j, se_b,
                   Q: tl.constexpr, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr):
    pid = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bi = bh // H
    h = bh % H
    nb = tl.num_programs(1) // H
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    # dF_ext = sum_{r > RANK} exp(T_{RANK+1} + ... + T_{r-1}) dS_in(r)
    g = tl.zeros([BLOCK], dtype=tl.float32)
    between = tl.zeros([], dtype=tl.float32)
    for r in range(RANK + 1, WORLD):
        g += tl.exp(between) * tl.load(E + r * se_j + bi * se_b + h * PN + offs, mask=mask, other=0.0)
        between += tl.load(TOT + (r * nb + bi) * H + h)
    cs_row = bh * NC * Q
    after = tl.zeros([], dtype=tl.float32)
    for cc in range(0, NC):
        c = NC - 1 - cc
        tot = _chunk_total(CS, cs_row, c, Q)
        at = ((bi * NC + c) * H + h) * PN + offs
        w = tl.exp(after)
        ds = tl.load(DSOUT0 + at, mask=mask, other=0.0).to(tl.float32) + w * g
        _store_rounded(DSOUT + at, ds, mask, EMULATE_BF16)
        s_in = tl.load(SIN + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(PARTS + (bh * NC + c) * tl.num_programs(0) + pid, tl.exp(tot) * w * tl.sum(s_in * g, 0))
        after += tot


def fold_outgoing_gradient(every: Tensor, totals: Tensor, rank: int, cs: Tensor, sin: Tensor,
                           dsout0: Tensor, dtot: Tensor, chunk: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Add the later ranks' gradient of this piece's final state: from ``dsout0`` (b, nc, h, p, n),
    the gradients of the states leaving its chunks given its own final-state gradient (fp32, so
    that they are rounded once), the gradients given that plus dF_ext in ``dtype``, and ``dtot``
    (b*h, nc, parts) with the total-decay gradient parts this adds appended.  ``every`` (W, b,
    >= h*p*n) fp32: every rank's incoming-state gradient in rank order; ``totals`` (W, b, h) fp32
    every rank's total log-decay; ``sin`` the states entering the chunks (from S_in); ``cs`` as
    for ``fold_incoming_state``."""
    world = every.shape[0]
    b, nc, h = dsout0.shape[0], dsout0.shape[1], dsout0.shape[2]
    pn = dsout0[0, 0, 0].numel()
    dsout = torch.empty(dsout0.shape, device=dsout0.device, dtype=dtype)
    if every.stride(-1) != 1:
        every = every.contiguous()
    block = 256 if interpreting() else 1024
    tiles = triton.cdiv(pn, block)
    parts = torch.empty(b * h, nc, tiles, device=dsout.device, dtype=torch.float32)
    _fold_outgoing[(tiles, b * h)](every, totals.to(torch.float32).contiguous(), cs, sin, dsout0, dsout, parts,
                                   rank, world, nc, h, pn, every.stride(0), every.stride(1), Q=chunk,
                                   BLOCK=block, EMULATE_BF16=_emulate_bf16(dtype), num_warps=4)
    return dsout, torch.cat([dtot, parts], dim=-1)
