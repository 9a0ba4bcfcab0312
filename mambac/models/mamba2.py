"""Reference Mamba-2 mixer in plain PyTorch plus mambac ops.

Constructor arguments, parameter names and shapes mirror mamba_ssm's ``Mamba2`` so checkpoints load
one to one.  The forward is written the way people write it: the dt bias, softplus and clamp, the D
skip and the z gate are ordinary PyTorch around a bare ``ssd`` call, and the conv's SiLU follows a
bare ``causal_conv1d``.  ``fuse_ssm`` folds that math into the ops' fused arguments.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambac import ops
from mambac.errors import MambacConfigError
from mambac.models.layers import RMSNormGated, init_dt_bias


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise MambacConfigError(f"Mamba2: {msg}")


class Mamba2(nn.Module):
    def __init__(self, d_model: int, d_state: int = 128, d_conv: int = 4, conv_init=None, expand: int = 2,
                 headdim: int = 64, d_ssm: int | None = None, ngroups: int = 1, A_init_range=(1, 16),
                 D_has_hdim: bool = False, rmsnorm: bool = True, norm_before_gate: bool = False,
                 dt_min: float = 0.001, dt_max: float = 0.1, dt_init_floor: float = 1e-4,
                 dt_limit=(0.0, float("inf")), bias: bool = False, conv_bias: bool = True,
                 chunk_size: int = 256, use_mem_eff_path: bool = True, layer_idx: int | None = None,
                 process_group=None, sequence_parallel: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        d_inner = expand * d_model
        d_ssm = d_inner if d_ssm is None else d_ssm
        _check(d_ssm <= d_inner and (d_inner - d_ssm) % 1 == 0, f"d_ssm={d_ssm} exceeds d_inner={d_inner}.")
        _check(headdim > 0 and d_ssm % headdim == 0,
               f"headdim={headdim} must divide d_ssm={d_ssm} (expand*d_model unless d_ssm is given).")
        nheads = d_ssm // headdim
        _check(ngroups > 0 and nheads % ngroups == 0, f"ngroups={ngroups} must divide the head count {nheads}.")
        _check(d_conv >= 1 and chunk_size > 0, f"d_conv={d_conv} and chunk_size={chunk_size} must be positive.")
        _check(len(dt_limit) == 2 and dt_limit[0] < dt_limit[1], f"dt_limit={dt_limit} must be (low, high), low < high.")
        self.d_model, self.d_state, self.d_conv, self.expand = d_model, d_state, d_conv, expand
        self.headdim, self.d_inner, self.d_ssm, self.ngroups, self.nheads = headdim, d_inner, d_ssm, ngroups, nheads
        self.D_has_hdim, self.rmsnorm, self.norm_before_gate = D_has_hdim, rmsnorm, norm_before_gate
        self.dt_limit, self.chunk_size, self.layer_idx = tuple(dt_limit), chunk_size, layer_idx
        kw = dict(device=device, dtype=dtype)
        d_in_proj = 2 * d_inner + 2 * ngroups * d_state + nheads
        self.in_proj = nn.Linear(d_model, d_in_proj, bias=bias, **kw)
        conv_dim = d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1,
                                bias=conv_bias, **kw)
        if conv_init is not None:
            nn.init.uniform_(self.conv1d.weight, -conv_init, conv_init)
        self.dt_bias = nn.Parameter(init_dt_bias(nheads, dt_min, dt_max, dt_init_floor, device))
        A = torch.empty(nheads, device=device).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A).to(dtype=dtype or torch.float32))
        self.D = nn.Parameter(torch.ones(d_ssm if D_has_hdim else nheads, device=device))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True
        if rmsnorm:
            self.norm = RMSNormGated(d_ssm, eps=1e-5, norm_before_gate=norm_before_gate,
                                     group_size=d_ssm // ngroups, **kw)
        self.out_proj = nn.Linear(d_inner, d_model, bias=bias, **kw)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        """u: (batch, seqlen, d_model) → (batch, seqlen, d_model)."""
        batch, seqlen = u.shape[0], u.shape[1]
        zxbcdt = self.in_proj(u)
        gn = self.ngroups * self.d_state
        d_mlp = (self.in_proj.out_features - 2 * self.d_ssm - 2 * gn - self.nheads) // 2
        z0, x0, z, xBC, dt = torch.split(zxbcdt, [d_mlp, d_mlp, self.d_ssm, self.d_ssm + 2 * gn, self.nheads], dim=-1)
        xBC = ops.causal_conv1d(xBC.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias)
        xBC = F.silu(xBC).transpose(1, 2)
        x, B, C = torch.split(xBC, [self.d_ssm, gn, gn], dim=-1)
        x = x.reshape(batch, seqlen, self.nheads, self.headdim)
        B = B.reshape(batch, seqlen, self.ngroups, self.d_state)
        C = C.reshape(batch, seqlen, self.ngroups, self.d_state)
        A = -torch.exp(self.A_log.float())
        dt = F.softplus(dt + self.dt_bias)
        if self.dt_limit != (0.0, float("inf")):
            dt = dt.clamp(min=self.dt_limit[0], max=self.dt_limit[1])
        y = ops.ssd(x, dt, A, B, C, chunk_size=self.chunk_size)
        D = self.D.reshape(self.nheads, self.headdim) if self.D_has_hdim else self.D.unsqueeze(-1)
        y = y + x * D
        if not self.rmsnorm:
            y = y * F.silu(z.reshape(batch, seqlen, self.nheads, self.headdim))
        y = y.reshape(batch, seqlen, self.d_ssm)
        if self.rmsnorm:
            y = self.norm(y, z)
        if d_mlp > 0:
            y = torch.cat([F.silu(z0) * x0, y], dim=-1)
        return self.out_proj(y)
