"""Reference Mamba-1 mixer in plain PyTorch plus mambac ops.

Arguments, parameter names and shapes mirror mamba_ssm's ``Mamba`` (``mamba_simple``).  As in
``Mamba2``, the delta bias and softplus, the D skip and the z gate are written as ordinary PyTorch
around a bare ``selective_scan`` call for ``fuse_ssm`` to fold.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambac import ops
from mambac.errors import MambacConfigError
from mambac.models.layers import init_dt_bias


class Mamba(nn.Module):
    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2, dt_rank="auto",
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init: str = "random", dt_scale: float = 1.0,
                 dt_init_floor: float = 1e-4, conv_bias: bool = True, bias: bool = False,
                 use_fast_path: bool = True, layer_idx: int | None = None, device=None, dtype=None) -> None:
        super().__init__()
        if dt_init not in ("random", "constant"):
            raise MambacConfigError(f"Mamba: dt_init must be 'random' or 'constant', got {dt_init!r}.")
        if d_model <= 0 or d_state <= 0 or d_conv <= 0 or expand <= 0:
            raise MambacConfigError("Mamba: d_model, d_state, d_conv and expand must be positive.")
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.d_inner = int(expand * d_model)
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        self.layer_idx = layer_idx
        kw = dict(device=device, dtype=dtype)
        self.in_proj = nn.Linear(d_model, 2 * self.d_inner, bias=bias, **kw)
        self.conv1d = nn.Conv1d(self.d_inner, self.d_inner, d_conv, groups=self.d_inner, padding=d_conv - 1,
                                bias=conv_bias, **kw)
        self.x_proj = nn.Linear(self.d_inner, self.dt_rank + 2 * d_state, bias=False, **kw)
        self.dt_proj = nn.Linear(self.dt_rank, self.d_inner, bias=True, **kw)
        std = self.dt_rank ** -0.5 * dt_scale
        with torch.no_grad():
            if dt_init == "constant":
                self.dt_proj.weight.fill_(std)
            else:
                self.dt_proj.weight.uniform_(-std, std)
            self.dt_proj.bias.copy_(init_dt_bias(self.d_inner, dt_min, dt_max, dt_init_floor, device))
        A = torch.arange(1, d_state + 1, dtype=torch.float32, device=device).repeat(self.d_inner, 1)
        self.A_log = nn.Parameter(torch.log(A))
        self.D = nn.Parameter(torch.ones(self.d_inner, device=device))
        self.A_log._no_weight_decay = True
        self.D._no_weight_decay = True
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=bias, **kw)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: (batch, seqlen, d_model) → (batch, seqlen, d_model)."""
        batch, seqlen = hidden_states.shape[0], hidden_states.shape[1]
        xz = self.in_proj(hidden_states).transpose(1, 2)
        x, z = xz.chunk(2, dim=1)
        x = F.silu(ops.causal_conv1d(x, self.conv1d.weight.squeeze(1), self.conv1d.bias))
        x_dbl = self.x_proj(x.transpose(1, 2))
        dt, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.linear(dt, self.dt_proj.weight).transpose(1, 2)
        delta = F.softplus(delta + self.dt_proj.bias.float().unsqueeze(-1))
        A = -torch.exp(self.A_log.float())
        y = ops.selective_scan(x, delta, A, B.transpose(1, 2), C.transpose(1, 2))
        y = y + x * self.D.float().unsqueeze(-1)
        y = y * F.silu(z)
        # the fp32 D skip promoted y; back to the scan input's dtype, as mamba_ssm's kernels return it
        # (a no-op in fp32 and wherever fuse_ssm folded the skip and the gate into the scan)
        return self.out_proj(y.type_as(x).transpose(1, 2))
