"""``mambac::add_rmsnorm``: residual add followed by RMSNorm, the pre-norm block entry.

``residual_out = x + residual`` (just ``x`` when there is no residual yet), computed in fp32 when
``residual_in_fp32``; ``out = rmsnorm(residual_out) * weight`` in the weight's dtype, as
mamba_ssm's unfused blocks and transformers' norms give it (``norm(residual.to(weight.dtype))``):
a bf16 model whose residual stream is kept in fp32 feeds its mixers bf16.  Returns
``(out, residual_out)``: the normalised stream feeds the mixer, the sum is the new residual.
A plain RMSNorm is this op with ``residual=None`` (``mambac.ops.rms_norm``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, compute_dtype,
                                register_info, register_recompute_autograd)


def _residual_dtype(x: Tensor, residual_in_fp32: bool) -> torch.dtype:
    if residual_in_fp32 and x.dtype != torch.float64:
        return torch.float32
    return x.dtype


def reference(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
              residual_in_fp32: bool) -> tuple[Tensor, Tensor]:
    ct = compute_dtype(x)
    h = x.to(ct) if residual is None else x.to(ct) + residual.to(ct)
    res_out = h.to(_residual_dtype(x, residual_in_fp32))
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(ct)
    return out.to(weight.dtype), res_out


@torch.library.custom_op("mambac::add_rmsnorm", mutates_args=())
def add_rmsnorm_op(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float,
                   residual_in_fp32: bool) -> tuple[Tensor, Tensor]:
    out, res = reference(x, residual, weight, eps, residual_in_fp32)
    return out.contiguous(), res.contiguous().clone() if res is x else res.contiguous()


@add_rmsnorm_op.register_fake
def _fake(x, residual, weight, eps, residual_in_fp32):
    return (x.new_empty(x.shape, dtype=weight.dtype),
            x.new_empty(x.shape, dtype=_residual_dtype(x, residual_in_fp32)))


register_recompute_autograd(add_rmsnorm_op, reference, n_outputs=2)

INFO = register_info(OpInfo(
    name="add_rmsnorm", op=torch.ops.mambac.add_rmsnorm, reference=reference,
    arg_names=("x", "residual", "weight", "eps", "residual_in_fp32"), n_outputs=2, doc=__doc__ or ""))


def add_rmsnorm(x: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float = 1e-5,
                residual_in_fp32: bool = False) -> tuple[Tensor, Tensor]:
    """Fused ``residual += x; out = rmsnorm(residual) * weight``; returns ``(out, residual)``."""
    if not isinstance(x, torch.fx.Proxy):
        check_float("add_rmsnorm", x=x, residual=residual, weight=weight)
        check_shape("add_rmsnorm", "weight", weight, (x.shape[-1],))
        if residual is not None:
            check(residual.shape == x.shape, "add_rmsnorm",
                  f"residual has shape {tuple(residual.shape)}, x {tuple(x.shape)}; they must match.")
    return torch.ops.mambac.add_rmsnorm(x, residual, weight, float(eps), bool(residual_in_fp32))


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """Plain RMSNorm over the last dimension (``add_rmsnorm`` with no residual)."""
    return add_rmsnorm(x, None, weight, eps, False)[0]
