"""The reference Mamba-3 mixer block in plain PyTorch plus mambac ops.

Parameter names and shapes are those of mamba_ssm's ``Mamba3`` module, so its state dicts load
1:1.  The block has no convolution; one input projection yields, in this order,

    z (d_inner) | x (d_inner) | B (r*g*n) | C (r*g*n) | dt (h) | A (h) | trap (h) | angles (s)

with r the MIMO rank (1 for SISO), g = ngroups, n = d_state, h = nheads, s = num_rope_angles.
Then dt = softplus(dt + dt_bias), A = -max(heavy_tail(A), A_floor), B and C are RMS-normalised
over n, and the Mamba-3 scan (``mambac.ops.mamba3_siso`` / ``mamba3_mimo``) mixes the sequence.
The output is gated by silu(z) inside the scan, or, with ``is_outproj_norm``, by a grouped
(per-head) gated RMSNorm after it; MIMO folds its r outputs with ``mimo_o`` after that norm.
mamba_ssm's ``fuse_pregate_headwise_norm`` only chooses a kernel; the math is the same, so it is
kept as an attribute and otherwise ignored.

``forward`` is traceable by ``torch.fx.symbolic_trace``: no branch depends on tensor values or
shapes, only on the configuration.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from mambac.errors import MambacConfigError
from mambac.models.layers import RMSNormGated, init_dt_bias
from mambac.ops import mamba3_mimo, mamba3_siso


def heavy_tail(x: Tensor) -> Tensor:
    """1 + x for x >= 0, 1 / (1 - x) below: positive, smooth at 0, with a slowly decaying left tail.
    Written with clamps (not ``where``) so neither branch can produce inf/NaN gradients."""
    return x.clamp(min=0) + (1 - x.clamp(max=0)).reciprocal()


class Mamba3(nn.Module):
    """Mamba-3 mixer: (batch, seqlen, d_model) -> (batch, seqlen, d_model).  See the module docstring."""

    def __init__(self, d_model: int, d_state: int = 128, expand: int = 2, headdim: int = 64, ngroups: int = 1,
                 rope_fraction: float = 0.5, dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, A_floor: float = 1e-4, is_outproj_norm: bool = False,
                 is_mimo: bool = False, mimo_rank: int = 4, fuse_pregate_headwise_norm: bool = True,
                 chunk_size: int = 64, dropout: float = 0.0, layer_idx: Optional[int] = None,
                 n_layer: Optional[int] = None, device=None, dtype=None) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.d_model, self.d_state, self.expand, self.headdim = d_model, d_state, expand, headdim
        self.ngroups = self.num_bc_heads = ngroups
        self.chunk_size, self.layer_idx, self.A_floor = chunk_size, layer_idx, A_floor
        self.is_outproj_norm, self.is_mimo = is_outproj_norm, is_mimo
        self.mimo_rank = mimo_rank if is_mimo else 1
        self.fuse_pregate_headwise_norm = bool(fuse_pregate_headwise_norm and is_mimo and is_outproj_norm)
        self.d_inner = int(expand * d_model)
        self._check_config(rope_fraction)
        self.nheads = self.d_inner // headdim
        self._init_rope(rope_fraction)
        self.in_proj = nn.Linear(d_model, sum(self._split_sizes()), bias=False, **factory)
        self._init_ssm_parameters(dt_min, dt_max, dt_init_floor, device)
        self.B_norm = RMSNormGated(d_state, eps=1e-5, **factory)
        self.C_norm = RMSNormGated(d_state, eps=1e-5, **factory)
        if is_outproj_norm:
            self.norm = RMSNormGated(self.d_inner, eps=1e-5, group_size=headdim, norm_before_gate=True, **factory)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False, **factory)

    def _check_config(self, rope_fraction: float) -> None:
        if self.d_inner % self.headdim:
            raise MambacConfigError(f"Mamba3: d_inner = expand * d_model = {self.d_inner} is not a multiple "
                                    f"of headdim={self.headdim}.")
        if (self.d_inner // self.headdim) % self.ngroups:
            raise MambacConfigError(f"Mamba3: nheads={self.d_inner // self.headdim} is not a multiple of "
                                    f"ngroups={self.ngroups}.")
        if rope_fraction not in (0.5, 1.0):
            raise MambacConfigError(f"Mamba3: rope_fraction must be 0.5 or 1.0, got {rope_fraction}.")
        if self.is_mimo and self.d_state % 2:
            raise MambacConfigError(f"Mamba3: MIMO rotates the halves of d_state; {self.d_state} is odd.")

    def _init_rope(self, rope_fraction: float) -> None:
        """Rotary sizes: a fraction of d_state (rounded down to pairs) turns, one angle per pair."""
        self.rope_fraction = rope_fraction
        self.rotary_dim_divisor = int(2 / rope_fraction)
        self.split_tensor_size = int(self.d_state * rope_fraction) // 2 * 2
        self.num_rope_angles = self.split_tensor_size // 2
        if self.num_rope_angles == 0:
            raise MambacConfigError(f"Mamba3: d_state={self.d_state} leaves no rotary angle at rope_fraction "
                                    f"{rope_fraction}; use d_state >= {self.rotary_dim_divisor}.")

    def _init_ssm_parameters(self, dt_min: float, dt_max: float, floor: float, device) -> None:
        """Per-head parameters, fp32 whatever ``dtype`` is (as in mamba_ssm)."""
        h, r, n, p = self.nheads, self.mimo_rank, self.d_state, self.headdim
        self.dt_bias = nn.Parameter(init_dt_bias(h, dt_min, dt_max, floor, device).float())
        self.dt_bias._no_weight_decay = True
        self.B_bias = nn.Parameter(torch.ones(h, r, n, device=device, dtype=torch.float32))
        self.C_bias = nn.Parameter(torch.ones(h, r, n, device=device, dtype=torch.float32))
        if self.is_mimo:
            self.mimo_x = nn.Parameter(torch.full((h, r, p), 1.0 / r, device=device))
            self.mimo_z = nn.Parameter(torch.ones(h, r, p, device=device))
            self.mimo_o = nn.Parameter(torch.full((h, r, p), 1.0 / r, device=device))
        self.D = nn.Parameter(torch.ones(h, device=device))
        self.D._no_weight_decay = True

    def _split_sizes(self) -> list[int]:
        bc = self.d_state * self.ngroups * self.mimo_rank
        h = self.nheads
        return [self.d_inner, self.d_inner, bc, bc, h, h, h, self.num_rope_angles]

    def forward(self, hidden_states: Tensor) -> Tensor:
        """hidden_states (batch, seqlen, d_model) -> (batch, seqlen, d_model)."""
        h, p, r, g, n = self.nheads, self.headdim, self.mimo_rank, self.ngroups, self.d_state
        z, x, B, C, dd_dt, dd_A, trap, angles = torch.split(self.in_proj(hidden_states), self._split_sizes(), -1)
        z, x = z.unflatten(-1, (h, p)), x.unflatten(-1, (h, p))
        B = self.B_norm(B.unflatten(-1, (r, g, n)))
        C = self.C_norm(C.unflatten(-1, (r, g, n)))
        dt = F.softplus(dd_dt + self.dt_bias)
        A = -heavy_tail(dd_A.to(self.dt_bias.dtype)).clamp(min=self.A_floor)
        angles = angles.unsqueeze(-2).expand(-1, -1, h, -1)
        scan = (x, B, C, dt, A * dt, trap, angles)
        y = self._mimo(scan, z) if self.is_mimo else self._siso(scan, z)
        return self.out_proj(y.flatten(2).to(x.dtype))

    def _siso(self, scan: tuple, z: Tensor) -> Tensor:
        x, B, C, *steps = scan
        gate_in_scan = not self.is_outproj_norm
        y = mamba3_siso(x, B[:, :, 0], C[:, :, 0], *steps, B_bias=self.B_bias[:, 0], C_bias=self.C_bias[:, 0],
                        D=self.D, z=z if gate_in_scan else None, chunk_size=self.chunk_size)
        if gate_in_scan:
            return y
        return self.norm(y.flatten(2), z.flatten(2))

    def _mimo(self, scan: tuple, z: Tensor) -> Tensor:
        gate_in_scan = not self.is_outproj_norm
        y = mamba3_mimo(*scan, mimo_x=self.mimo_x, B_bias=self.B_bias, C_bias=self.C_bias,
                        mimo_z=self.mimo_z if gate_in_scan else None, mimo_o=self.mimo_o if gate_in_scan else None,
                        D=self.D, z=z if gate_in_scan else None, chunk_size=self.chunk_size)
        if gate_in_scan:
            return y
        # per-rank outputs (b, l, r, h, p): normalise each head, gate by its rank's z, fold the ranks
        z_r = z.unsqueeze(2) * self.mimo_z.transpose(0, 1)
        y = self.norm(y.flatten(3), z_r.flatten(3)).unflatten(-1, (self.nheads, self.headdim))
        return (y * self.mimo_o.transpose(0, 1)).sum(2)
