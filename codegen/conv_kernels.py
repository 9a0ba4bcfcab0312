"""Generated-kernel implementation of ``mambac::causal_conv1d``: launchers and registration.

One forward launch (y and the final state) and one backward launch (dx, d initial state and
per-tile partials of dweight / dbias, summed here).  Sources come from ``render_conv`` for the
region the call describes, through the same render -> write -> import -> autotune stages as the
SSD kernels (``ssd_launch.run_family``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from mambac.codegen import autotune, render_conv
from mambac.codegen.conv_norm_ir import ConvRegion, stride_hints
from mambac.codegen.kernel_ir import TileConfig
from mambac.codegen.ssd_launch import Family, cdiv, run_family
from mambac.ops.causal_conv1d import output_like


@dataclass(frozen=True)
class ConvDims:
    b: int
    d: int
    l: int
    width: int

    def bucket(self) -> str:
        return autotune.bucket_key(self.b, self.d, self.l, self.width)


def _candidates(d: ConvDims) -> list[TileConfig]:
    """block_m: channels per program, block_k: steps per program."""
    if autotune.interpreting():
        return [TileConfig(block_m=16, block_k=16, num_warps=1)]
    # no spills on sm_90 at width 4 with every flag (ptxas resource usage of the rendered kernels)
    return [TileConfig(block_m=bm, block_k=bl, num_warps=w, num_stages=1)
            for bm, bl, w in ((64, 64, 8), (32, 64, 4), (64, 32, 4), (128, 32, 8))]


def _bwd_candidates(d: ConvDims) -> list[TileConfig]:
    """The backward keeps 2*width-1 shifted input tiles live: smaller tiles first."""
    if autotune.interpreting():
        return _candidates(d)
    return [TileConfig(block_m=bm, block_k=bl, num_warps=w, num_stages=1)
            for bm, bl, w in ((64, 32, 8), (32, 32, 4), (32, 64, 8), (16, 64, 4))]


FWD = Family(render_conv.FWD_NAME, lambda r, c: render_conv.render_forward(r), _candidates)
BWD = Family(render_conv.BWD_NAME, lambda r, c: render_conv.render_backward(r), _bwd_candidates)


def region_of(weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor], activation: str,
              dfinal: Optional[Tensor] = None, **strided: Optional[Tensor]) -> ConvRegion:
    """The region of a call; ``strided`` maps each strided tensor's argument prefix ("x", "o", ...)
    to the tensor, for the alignment hints of its strides."""
    width = int(weight.shape[1])
    has_init = initial_state is not None and width > 1
    named = {f"s{p}{axis}": v for p, t in strided.items() if t is not None and (p != "i" or has_init)
             for axis, v in zip("bdl", t.stride())}
    return ConvRegion(width=width, has_bias=bias is not None, silu=activation == "silu",
                      has_initial_state=has_init, has_dfinal=dfinal is not None and width > 1,
                      hints=stride_hints(**named))


def _strides(t: Tensor) -> list[int]:
    return [t.stride(0), t.stride(1), t.stride(2)]


def conv_forward(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                 activation: str) -> tuple[Tensor, Tensor]:
    """(y, final_state) of ``mambac::causal_conv1d`` with the generated forward kernel."""
    y = output_like(x)
    r = region_of(weight, bias, initial_state, activation, x=x, i=initial_state, o=y)
    b, dim, l = x.shape
    dims = ConvDims(b, dim, l, r.width)
    final = torch.empty(b, dim, r.width - 1, device=x.device, dtype=x.dtype)
    w = weight.contiguous()
    head = [x, w] + ([bias] if r.has_bias else []) + ([initial_state] if r.has_initial_state else [])
    tail = _strides(x) + (_strides(initial_state) if r.has_initial_state else []) + _strides(y)

    def launch(kern, cfg: TileConfig) -> None:
        kern.launch((cdiv(l, cfg.block_k), cdiv(dim, cfg.block_m), b), head + [y, final, l, dim] + tail,
                    dict(BD=cfg.block_m, BL=cfg.block_k), cfg)

    run_family(FWD, r, dims, launch)
    return y, final


def conv_backward(dy: Optional[Tensor], dfinal: Optional[Tensor], x: Tensor, weight: Tensor,
                  bias: Optional[Tensor], initial_state: Optional[Tensor], activation: str):
    """(dx, dweight, dbias, d initial_state) with the generated backward kernel (None where an
    input is absent)."""
    if dy is None:
        dy = torch.zeros_like(x)
    dx = output_like(x)
    r = region_of(weight, bias, initial_state, activation, dfinal, x=x, i=initial_state, g=dy, o=dx)
    b, dim, l = x.shape
    width = r.width
    dims = ConvDims(b, dim, l, width)
    dinit = None
    if initial_state is not None:
        dinit = (torch.empty(b, dim, width - 1, device=x.device, dtype=initial_state.dtype) if r.has_initial_state
                 else torch.zeros_like(initial_state))
    w = weight.contiguous()
    head = [x, w] + ([bias] if r.has_bias else []) + ([initial_state] if r.has_initial_state else [])
    head += [dy] + ([dfinal.contiguous()] if r.has_dfinal else []) + [dx]
    head += [dinit] if r.has_initial_state else []

    def launch(kern, cfg: TileConfig):
        nt = cdiv(l + width - 1, cfg.block_k)
        dw = torch.empty(b, nt, dim, width, device=x.device, dtype=torch.float32)
        db = torch.empty(b, nt, dim, device=x.device, dtype=torch.float32) if r.has_bias else None
        args = head + [dw] + ([db] if db is not None else []) + [l, dim, nt] + _strides(x)
        args += (_strides(initial_state) if r.has_initial_state else []) + _strides(dy) + _strides(dx)
        kern.launch((nt, cdiv(dim, cfg.block_m), b), args, dict(BD=cfg.block_m, BL=cfg.block_k), cfg)
        return dw, db

    dw, db = run_family(BWD, r, dims, launch)
    dweight = dw.sum((0, 1)).to(weight.dtype)
    dbias = None if bias is None else db.sum((0, 1)).to(bias.dtype)
    return dx, dweight, dbias, dinit


def _forward(x, weight, bias, initial_state, activation):
    return conv_forward(x, weight, bias, initial_state, activation)


def _backward(args: list, grads: tuple, needs: tuple) -> tuple:
    x, weight, bias, initial_state, activation = args
    dy, dfinal = grads
    dx, dw, db, dinit = conv_backward(dy, dfinal, x, weight, bias, initial_state, activation)
    return dx, dw, db, dinit, None


def _supports(x, weight, bias, initial_state, activation) -> bool:
    from mambac.codegen.wiring import tensors_supported
    return activation in ("none", "silu") and x.dim() == 3 and tensors_supported(x, weight, bias, initial_state)


def register() -> None:
    from mambac.ops._common import register_device_kernels
    register_device_kernels("causal_conv1d", "cuda", forward=_forward, backward=_backward, supports=_supports)
