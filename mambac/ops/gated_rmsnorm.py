"""``mambac::gated_rmsnorm``: RMSNorm with an optional SiLU gate, normalised in groups.

Matches mamba_ssm's ``RMSNormGated``: with a gate z and ``norm_before_gate=False`` the input is
gated first, ``x * silu(z)``, then normalised; with ``norm_before_gate=True`` it is normalised first
and the result gated.  The last dimension is split into groups of ``group_size`` features, each
normalised on its own (``group_size`` equal to the last dimension is a plain RMSNorm).  Under tensor
parallelism a group never straddles ranks, which is why the group size is explicit.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, compute_dtype,
                                register_info, register_recompute_autograd)


def reference(x: Tensor, weight: Tensor, z: Optional[Tensor], eps: float, group_size: int,
              norm_before_gate: bool) -> Tensor:
    ct = compute_dtype(x)
    h = x.to(ct)
    if z is not None and not norm_before_gate:
        h = h * F.silu(z.to(ct))
    shape = h.shape
    g = h.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    out = g.reshape(shape) * weight.to(ct)
    if z is not None and norm_before_gate:
        out = out * F.silu(z.to(ct))
    return out.to(x.dtype)


@torch.library.custom_op("mambac::gated_rmsnorm", mutates_args=())
def gated_rmsnorm_op(x: Tensor, weight: Tensor, z: Optional[Tensor], eps: float, group_size: int,
                     norm_before_gate: bool) -> Tensor:
    return reference(x, weight, z, eps, group_size, norm_before_gate).contiguous()


@gated_rmsnorm_op.register_fake
def _fake(x, weight, z, eps, group_size, norm_before_gate):
    return x.new_empty(x.shape)


register_recompute_autograd(gated_rmsnorm_op, reference, n_outputs=1)

INFO = register_info(OpInfo(
    name="gated_rmsnorm", op=torch.ops.mambac.gated_rmsnorm, reference=reference,
    arg_names=("x", "weight", "z", "eps", "group_size", "norm_before_gate"), n_outputs=1,
    doc=__doc__ or ""))


def gated_rmsnorm(x: Tensor, weight: Tensor, z: Optional[Tensor] = None, eps: float = 1e-5,
                  group_size: Optional[int] = None, norm_before_gate: bool = False) -> Tensor:
    """Gated, grouped RMSNorm over the last dimension; see the module docstring."""
    if isinstance(x, torch.fx.Proxy):
        gs = group_size if group_size is not None else weight.shape[-1]
        return torch.ops.mambac.gated_rmsnorm(x, weight, z, eps, gs, norm_before_gate)
    gs = x.shape[-1] if group_size is None else group_size
    check_float("gated_rmsnorm", x=x, weight=weight, z=z)
    check_shape("gated_rmsnorm", "weight", weight, (x.shape[-1],))
    if z is not None:
        check(z.shape == x.shape, "gated_rmsnorm", f"z has shape {tuple(z.shape)}, x {tuple(x.shape)}; they must match.")
    check(gs > 0 and x.shape[-1] % gs == 0, "gated_rmsnorm",
          f"group_size {gs} must divide the normalised dimension {x.shape[-1]}.")
    return torch.ops.mambac.gated_rmsnorm(x, weight, z, float(eps), int(gs), bool(norm_before_gate))
