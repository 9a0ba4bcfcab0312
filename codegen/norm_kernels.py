"""Generated-kernel implementations of ``mambac::gated_rmsnorm`` and ``mambac::add_rmsnorm``.

One launch each way per op (``render_norm``); the backward's per-program dw partials are summed
here.  Inputs are viewed as (rows, features); a feature dim that is not dense is copied first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from mambac.codegen import autotune, render_norm
from mambac.codegen.conv_norm_ir import AddNormRegion, GatedNormRegion, stride_hints
from mambac.codegen.kernel_ir import TileConfig, pow2
from mambac.codegen.ssd_launch import Family, cdiv, run_family


MAX_WIDTH = 16384  # a (group of) features is one tile of a program; wider rows take the reference


@dataclass(frozen=True)
class RowDims:
    m: int
    n: int
    g: int

    def bucket(self) -> str:
        return autotune.bucket_key(self.m, self.n, self.g)


def _candidates(d: RowDims) -> list[TileConfig]:
    """block_m: rows per program (fewer for wide rows, to bound the live tile)."""
    if autotune.interpreting():
        return [TileConfig(block_m=4, num_warps=1)]
    width = pow2(d.g)
    out = []
    for elems, warps in ((4096, 4), (8192, 8), (2048, 4)):
        bm = max(1, min(64, elems // width))
        out.append(TileConfig(block_m=bm, num_warps=warps, num_stages=1))
    return list(dict.fromkeys(out))


GATED_FWD = Family(render_norm.GATED_FWD, lambda r, c: render_norm.render_gated_forward(r), _candidates)
GATED_BWD = Family(render_norm.GATED_BWD, lambda r, c: render_norm.render_gated_backward(r), _candidates)
ADD_FWD = Family(render_norm.ADD_FWD, lambda r, c: render_norm.render_add_forward(r), _candidates)
ADD_BWD = Family(render_norm.ADD_BWD, lambda r, c: render_norm.render_add_backward(r), _candidates)


def _rows(t: Optional[Tensor], n: int) -> Optional[Tensor]:
    """(rows, n) view with a dense last dim (copied only when needed)."""
    if t is None:
        return None
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _row_strides(N: int, **views: Optional[Tensor]) -> dict[str, int]:
    """Kernel stride arguments (and the dense output row stride N) of the row views present."""
    return {"N": N, **{name: v.stride(0) for name, v in views.items() if v is not None}}


# ---- gated RMSNorm ------------------------------------------------------------------------------

def gated_region(z: Optional[Tensor], group_size: int, norm_before_gate: bool, **strides: int) -> GatedNormRegion:
    return GatedNormRegion(has_z=z is not None, norm_before_gate=bool(norm_before_gate) and z is not None,
                           group_pow2=pow2(group_size), hints=stride_hints(**strides))


def gated_forward(x: Tensor, weight: Tensor, z: Optional[Tensor], eps: float, group_size: int,
                  norm_before_gate: bool) -> Tensor:
    n = x.shape[-1]
    x2, z2 = _rows(x, n), _rows(z, n)
    r = gated_region(z, group_size, norm_before_gate, **_row_strides(N=n, sxm=x2, szm=z2))
    m = x2.shape[0]
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    dims = RowDims(m, n, group_size)
    args = [x2, weight.contiguous()] + ([z2] if z is not None else []) + [y, m, n, group_size, float(eps),
                                                                          x2.stride(0)]
    args += [z2.stride(0)] if z is not None else []

    def launch(kern, cfg: TileConfig) -> None:
        kern.launch((cdiv(m, cfg.block_m), n // group_size), args, dict(BM=cfg.block_m), cfg)

    run_family(GATED_FWD, r, dims, launch)
    return y


def gated_backward(dy: Tensor, x: Tensor, weight: Tensor, z: Optional[Tensor], eps: float, group_size: int,
                   norm_before_gate: bool):
    """(dx, dweight, dz or None)."""
    n = x.shape[-1]
    x2, z2, g2 = _rows(x, n), _rows(z, n), _rows(dy, n)
    r = gated_region(z, group_size, norm_before_gate, **_row_strides(N=n, sxm=x2, sgm=g2, szm=z2))
    m = x2.shape[0]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    dz = None if z is None else torch.empty(z.shape, device=z.device, dtype=z.dtype)
    dims = RowDims(m, n, group_size)
    head = [x2, weight.contiguous()] + ([z2] if z is not None else []) + [g2, dx] + ([dz] if z is not None else [])
    tail = [m, n, group_size, float(eps), x2.stride(0)] + ([z2.stride(0)] if z is not None else []) + [g2.stride(0)]

    def launch(kern, cfg: TileConfig) -> Tensor:
        parts = torch.empty(cdiv(m, cfg.block_m), n, device=x.device, dtype=torch.float32)
        kern.launch((cdiv(m, cfg.block_m), n // group_size), head + [parts] + tail, dict(BM=cfg.block_m), cfg)
        return parts

    parts = run_family(GATED_BWD, r, dims, launch)
    return dx, parts.sum(0).to(weight.dtype), dz


def _gated_fwd(x, weight, z, eps, group_size, norm_before_gate):
    return gated_forward(x, weight, z, eps, group_size, norm_before_gate)


def _gated_bwd(args: list, grads: tuple, needs: tuple) -> tuple:
    x, weight, z, eps, group_size, nbg = args
    (dy,) = grads
    if dy is None:
        dy = torch.zeros_like(x)
    dx, dw, dz = gated_backward(dy, x, weight, z, eps, group_size, nbg)
    return dx, dw, dz, None, None, None


def _gated_supports(x, weight, z, eps, group_size, nbg) -> bool:
    from mambac.codegen.wiring import tensors_supported
    return (x.dim() >= 1 and group_size <= MAX_WIDTH and x.shape[-1] % group_size == 0
            and tensors_supported(x, weight, z))


# ---- residual add + RMSNorm ---------------------------------------------------------------------

def _res_dtype(x: Tensor, residual_in_fp32: bool) -> torch.dtype:
    return torch.float32 if residual_in_fp32 else x.dtype


def add_forward(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                residual_in_fp32: bool) -> tuple[Tensor, Tensor]:
    n = x.shape[-1]
    x2, r2 = _rows(x, n), _rows(residual, n)
    r = AddNormRegion(has_residual=residual is not None, width_pow2=pow2(n),
                      hints=stride_hints(**_row_strides(N=n, sxm=x2, srm=r2)))
    m = x2.shape[0]
    out = torch.empty(x.shape, device=x.device, dtype=weight.dtype)
    res_out = torch.empty(x.shape, device=x.device, dtype=_res_dtype(x, residual_in_fp32))
    args = [x2] + ([r2] if r2 is not None else []) + [weight.contiguous(), out, res_out, m, n, float(eps),
                                                      x2.stride(0)]
    args += [r2.stride(0)] if r2 is not None else []

    def launch(kern, cfg: TileConfig) -> None:
        kern.launch((cdiv(m, cfg.block_m),), args, dict(BM=cfg.block_m), cfg)

    run_family(ADD_FWD, r, RowDims(m, n, n), launch)
    return out, res_out


def add_backward(dout: Optional[Tensor], dres: Optional[Tensor], x: Tensor, residual: Optional[Tensor],
                 weight: Tensor, eps: float):
    """(dx, dresidual or None, dweight)."""
    n = x.shape[-1]
    x2, r2, g2, d2 = _rows(x, n), _rows(residual, n), _rows(dout, n), _rows(dres, n)
    r = AddNormRegion(has_residual=residual is not None, width_pow2=pow2(n), has_dout=dout is not None,
                      has_dres=dres is not None,
                      hints=stride_hints(**_row_strides(N=n, sxm=x2, srm=r2, sgm=g2, sdm=d2)))
    m = x2.shape[0]
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    dresid = None if residual is None else torch.empty(residual.shape, device=x.device, dtype=residual.dtype)
    head = [x2] + ([r2] if r2 is not None else []) + [weight.contiguous()]
    head += ([g2] if g2 is not None else []) + ([d2] if d2 is not None else []) + [dx]
    head += [dresid] if dresid is not None else []
    tail = [m, n, float(eps), x2.stride(0)] + ([r2.stride(0)] if r2 is not None else [])
    tail += ([g2.stride(0)] if g2 is not None else []) + ([d2.stride(0)] if d2 is not None else [])

    def launch(kern, cfg: TileConfig) -> Tensor:
        parts = torch.zeros(cdiv(m, cfg.block_m), n, device=x.device, dtype=torch.float32)
        kern.launch((cdiv(m, cfg.block_m),), head + [parts] + tail, dict(BM=cfg.block_m), cfg)
        return parts

    parts = run_family(ADD_BWD, r, RowDims(m, n, n), launch)
    return dx, dresid, parts.sum(0).to(weight.dtype)


def _add_fwd(x, residual, weight, eps, residual_in_fp32):
    return add_forward(x, residual, weight, eps, residual_in_fp32)


def _add_bwd(args: list, grads: tuple, needs: tuple) -> tuple:
    x, residual, weight, eps, _ = args
    dout, dres = grads
    dx, dresid, dw = add_backward(dout, dres, x, residual, weight, eps)
    return dx, dresid, dw, None, None


def _add_supports(x, residual, weight, eps, residual_in_fp32) -> bool:
    from mambac.codegen.wiring import tensors_supported
    return x.dim() >= 1 and x.shape[-1] <= MAX_WIDTH and tensors_supported(x, residual, weight)


def register() -> None:
    from mambac.ops._common import register_device_kernels
    register_device_kernels("gated_rmsnorm", "cuda", forward=_gated_fwd, backward=_gated_bwd,
                            supports=_gated_supports)
    register_device_kernels("add_rmsnorm", "cuda", forward=_add_fwd, backward=_add_bwd, supports=_add_supports)
