"""Small building blocks shared by the reference models: RMSNorm, gated RMSNorm, gated MLP.

Parameter names match mamba_ssm's modules so that state dicts load unchanged.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambac import ops


class RMSNorm(nn.Module):
    """RMSNorm with a weight (mamba_ssm's ``RMSNorm``); called through ``add_rmsnorm`` in blocks."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class RMSNormGated(nn.Module):
    """Grouped RMSNorm with a SiLU gate (mamba_ssm's ``RMSNormGated``)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, norm_before_gate: bool = False,
                 group_size: int | None = None, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.group_size = hidden_size if group_size is None else group_size
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return ops.gated_rmsnorm(x, self.weight, z, self.eps, self.group_size, self.norm_before_gate)


class GatedMLP(nn.Module):
    """SwiGLU MLP (mamba_ssm's ``GatedMLP``): fc1 → split → y * silu(gate) → fc2."""

    def __init__(self, in_features: int, hidden_features: int | None = None, out_features: int | None = None,
                 bias: bool = False, multiple_of: int = 128, device=None, dtype=None) -> None:
        super().__init__()
        out_features = out_features if out_features is not None else in_features
        hidden = hidden_features if hidden_features is not None else int(8 * in_features / 3)
        hidden = (hidden + multiple_of - 1) // multiple_of * multiple_of
        self.fc1 = nn.Linear(in_features, 2 * hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(hidden, out_features, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * F.silu(gate))


def init_dt_bias(nheads: int, dt_min: float, dt_max: float, dt_init_floor: float, device=None) -> torch.Tensor:
    """Inverse-softplus of a log-uniform dt in [dt_min, dt_max], floored (the Mamba initialisation)."""
    u = torch.rand(nheads, device=device)
    dt = torch.exp(u * (torch.log(torch.tensor(dt_max)) - torch.log(torch.tensor(dt_min)))
                   + torch.log(torch.tensor(dt_min))).clamp(min=dt_init_floor)
    return dt + torch.log(-torch.expm1(-dt))
