"""Weighted sums over ranks of context-parallel summaries (``runtime.cp_ssd_fused``).

After an all-gather every rank holds a stack of per-rank rows, (W, b, >= h*pn) fp32.  Its
incoming state is a weighted sum of the earlier ranks' final states, and in the backward the
gradient of its own final state is a weighted sum of the later ranks' incoming-state gradients;
both are

    out[b, i] = sum_{j < J} w[j, b, i // pn] * x[j, b, i]      (i < h*pn)

with one weight per (rank, batch, head).  One launch reads each of the J rows once and writes the
sum once (a broadcast multiply and ``sum`` over ranks would also write and read the products).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mambac.codegen.autotune import interpreting


@triton.jit
def _weighted_rows(X, Wt, OUT, J, N, PN, H, sx_j, sx_b, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    bb = tl.program_id(1).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    head = offs // PN
    nb = tl.num_programs(1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in range(0, J):
        w = tl.load(Wt + (j * nb + bb) * H + head, mask=mask, other=0.0)
        x = tl.load(X + j * sx_j + bb * sx_b + offs, mask=mask, other=0.0)
        acc += w * x
    tl.store(OUT + bb * N + offs, acc, mask=mask)


def weighted_rows(x: Tensor, w: Tensor, n: int) -> Tensor:
    """``out (b, n)`` fp32 with ``out[b, i] = sum_j w[j, b, i // (n // h)] * x[j, b, i]``.

    ``x``: (J, b, >= n) fp32, unit stride along the last dim; ``w``: (J, b, h) fp32 with h
    dividing n.  J may be 0 (the sum is then zero)."""
    rows, b = x.shape[0], x.shape[1]
    h = w.shape[-1]
    out = torch.empty(b, n, device=x.device, dtype=torch.float32)
    if rows == 0 or n == 0:
        return out.zero_()
    if x.stride(-1) != 1:
        x = x.contiguous()
    w = w.to(torch.float32).contiguous()
    block = 256 if interpreting() else 1024
    _weighted_rows[(triton.cdiv(n, block), b)](x, w, out, rows, n, n // h, h, x.stride(0), x.stride(1),
                                               BLOCK=block, num_warps=4)
    return out
