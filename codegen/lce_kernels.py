"""Generated-kernel implementation of the softmax part of ``mambac.ops.linear_cross_entropy``.

The op computes one chunk of logits at a time with ``F.linear``; two launches replace the PyTorch
elementwise passes over that chunk (``render_lce``): ``lce_stats`` in the forward (per-row
log-sum-exp and loss term, one read of the chunk) and ``lce_grad_`` in the backward (the logits'
gradient written over the logits, one read and one write, no second chunk-sized buffer).  The
op decides in its forward whether these run (``mambac.ops._common.kernels_enabled`` and the
dtypes of ``kernel_ir.KERNEL_DTYPES``), so its backward takes the same path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mambac.codegen import autotune, render_lce
from mambac.codegen.conv_norm_ir import Hints, hint_text, stride_hints
from mambac.codegen.kernel_ir import KERNEL_DTYPES, TileConfig, io_name, pow2
from mambac.codegen.ssd_launch import Family, cdiv, run_family

@dataclass(frozen=True)
class LceRegion:
    """One chunk's softmax kernels: the logits' dtype (the gradient is stored in it), whether a
    bf16 store rounds to nearest even in the kernel itself (under the interpreter, whose cast
    truncates), and the alignment of the logits' row stride."""

    io_dtype: str
    round_bf16: bool = False
    hints: Hints = ()

    def summary(self) -> str:
        rounding = " round_bf16" if self.round_bf16 else ""
        return f"linear_cross_entropy io={self.io_dtype}{rounding}{hint_text(self.hints)}"


@dataclass(frozen=True)
class LceDims:
    """Sizes of one chunk: rows (tokens) and vocab."""

    m: int
    v: int

    def bucket(self) -> str:
        return autotune.bucket_key(self.m, self.v)


# (rows per program, vocab tile, warps): a program streams its rows' logits through registers.
# On an H200 at 1334 x 50288 bf16 logits the first reads at 2.5 TB/s (stats 0.053 ms, grad
# 0.104 ms); the others are within 10% there except 4 rows (stats 0.084 ms); fp32 chunks prefer
# the 4096-wide tile in the gradient
_TILES = ((1, 2048, 4), (1, 4096, 8), (2, 2048, 8), (4, 1024, 8))


def _candidates(d: LceDims) -> list[TileConfig]:
    """block_m: rows per program; block_k: the vocab tile (at most the vocab, as a power of two)."""
    if autotune.interpreting():
        return [TileConfig(block_m=4, block_k=256, num_warps=1)]
    cap = max(16, pow2(d.v))
    out = [TileConfig(block_m=bm, block_k=min(bv, cap), num_warps=w, num_stages=1) for bm, bv, w in _TILES]
    return list(dict.fromkeys(out))


STATS = Family(render_lce.STATS, lambda r, c: render_lce.render_stats(r), _candidates)
GRAD = Family(render_lce.GRAD, lambda r, c: render_lce.render_grad(r), _candidates)


def _region(z: Tensor, rounding: bool) -> LceRegion:
    io = io_name(z.dtype)
    return LceRegion(io_dtype=io, round_bf16=rounding and io == "bf16" and autotune.interpreting(),
                     hints=stride_hints(szm=z.stride(0)))


def _check(logits: Tensor, labels: Tensor) -> None:
    if logits.dim() != 2 or labels.shape != logits.shape[:1] or logits.dtype not in KERNEL_DTYPES:
        raise ValueError(f"lce kernels take logits (N, V) in fp32/bf16/fp16 and labels (N,); got "
                         f"{tuple(logits.shape)} {logits.dtype} and {tuple(labels.shape)}")


def _launcher(args: list, m: int):
    def launch(kern, cfg: TileConfig) -> None:
        kern.launch((cdiv(m, cfg.block_m),), args, dict(BM=cfg.block_m, BV=cfg.block_k), cfg)
    return launch


def lce_stats(logits: Tensor, labels: Tensor, ignore_index: int) -> tuple[Tensor, Tensor]:
    """(lse, loss terms) of one chunk, fp32 of shape (N,): ``logsumexp(logits[i])`` and
    ``lse[i] - logits[i, labels[i]]``, 0 where ``labels[i] == ignore_index``."""
    _check(logits, labels)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    m, v = z.shape
    lse = torch.empty(m, device=z.device, dtype=torch.float32)
    loss = torch.empty(m, device=z.device, dtype=torch.float32)
    if m == 0:
        return lse, loss
    args = [z, labels.long().contiguous(), lse, loss, m, v, z.stride(0), int(ignore_index)]
    run_family(STATS, _region(z, rounding=False), LceDims(m, v), _launcher(args, m))
    return lse, loss


def lce_grad_(logits: Tensor, lse: Tensor, labels: Tensor, ignore_index: int, scale: Tensor | float) -> Tensor:
    """Overwrite ``logits`` with ``(softmax(logits) - onehot(labels)) * scale`` (0 on rows whose
    label is ``ignore_index``) and return it.  ``lse`` is ``lce_stats``' first output; ``scale``
    a float or a one-element tensor (read on the device, so no host sync)."""
    _check(logits, labels)
    z = logits if logits.stride(1) == 1 else logits.contiguous()
    m, v = z.shape
    if m == 0:
        return logits
    if isinstance(scale, Tensor):
        sc = scale.detach().reshape(1).to(device=z.device, dtype=torch.float32)
    else:
        sc = torch.full((1,), float(scale), device=z.device, dtype=torch.float32)
    tail = [lse.float().contiguous(), labels.long().contiguous(), sc, m, v, z.stride(0), int(ignore_index)]

    def on_scratch():
        # autotuning launches the kernel repeatedly: let it rewrite a copy (same layout), not the logits
        scratch = torch.empty_strided(z.shape, z.stride(), dtype=z.dtype, device=z.device).copy_(z)
        return _launcher([scratch] + tail, m)

    run_family(GRAD, _region(z, rounding=True), LceDims(m, v), _launcher([z] + tail, m), tuning_launch=on_scratch)
    if z is not logits:
        logits.copy_(z)
    return logits
