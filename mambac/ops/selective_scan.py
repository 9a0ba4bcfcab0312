"""``mambac::selective_scan``: the Mamba-1 selective scan, with an optional initial state.

Layout follows mamba_ssm's ``selective_scan_fn``: u and delta (batch, dim, seqlen), A (dim, dstate),
B and C (batch, dstate, seqlen), or grouped (batch, ngroups, dstate, seqlen) with dim % ngroups == 0
(channel i reads group i // (dim // ngroups)), D (dim,), z like u, delta_bias (dim,),
initial_state (batch, dim, dstate).  With delta' = softplus(delta + delta_bias) (each step
optional), per channel and state index:

    h_t = exp(delta'_t * A) * h_{t-1} + delta'_t * B_t * u_t
    out_t = C_t . h_t + D * u_t,   then out_t *= silu(z_t) when z is given

Returns ``(out, last_state)``: out has u's dtype, last_state = h_L (batch, dim, dstate) is fp32
(float64 when an input is float64), as is every step of the recurrence.

The reference runs the linear recurrence as a blocked parallel prefix scan (see ``linear_scan``):
vectorised over time, a few passes over the state tensor.  It only ever multiplies decays (each
<= 1 for negative A), never divides by them, so it cannot overflow the way a
cumulative-product-and-divide form can.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, register_info,
                                register_recompute_autograd, state_dtype)

OP = "selective_scan"
SCHEMA = ("(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
          "Tensor? delta_bias, Tensor? initial_state, bool delta_softplus) -> (Tensor out, Tensor last_state)")
ARG_NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state", "delta_softplus")
SCAN_BLOCK = 32  # steps per block of the two-level scan in ``linear_scan``


def _doubling_scan(decay: Tensor, drive: Tensor) -> tuple[Tensor, Tensor]:
    """Hillis-Steele scan of h_t = decay_t * h_{t-1} + drive_t (h before step 0 is zero), last dim.

    After the step with offset k, ``drive[t]`` holds the recurrence folded over the window
    (t - 2k, t] and ``decay[t]`` the product of the decays over that window; windows double until
    they cover the whole prefix.  Returns (decay product from step 0 to t, h_t).
    """
    k, L = 1, decay.shape[-1]
    while k < L:
        drive = torch.cat([drive[..., :k], drive[..., k:] + decay[..., k:] * drive[..., :-k]], dim=-1)
        decay = torch.cat([decay[..., :k], decay[..., k:] * decay[..., :-k]], dim=-1)
        k *= 2
    return decay, drive


def linear_scan(decay: Tensor, drive: Tensor, block: int = SCAN_BLOCK) -> Tensor:
    """All states of h_t = decay_t * h_{t-1} + drive_t (h before step 0 is zero) along the last dim.

    Two levels: a doubling scan inside blocks of ``block`` steps (all blocks at once), then the
    same scan, recursively, over the blocks' end states to get each block's incoming state, which
    reaches step t scaled by the decay product from the block start.  This needs about
    log2(block) + 1 passes over the full tensor instead of log2(seqlen).
    """
    L = decay.shape[-1]
    if L <= block:
        return _doubling_scan(decay, drive)[1]
    pad = (-L) % block  # padded steps sit after the last real one and are sliced away
    cum, local = _doubling_scan(F.pad(decay, (0, pad), value=1.0).unflatten(-1, (-1, block)),
                                F.pad(drive, (0, pad)).unflatten(-1, (-1, block)))
    ends = linear_scan(cum[..., -1], local[..., -1], block)          # state after each block
    incoming = F.pad(ends[..., :-1], (1, 0)).unsqueeze(-1)          # state entering each block
    return (local + cum * incoming).flatten(-2)[..., :L]


def _per_channel(M: Tensor, dim: int) -> Tensor:
    """B or C as (batch, dim or 1, dstate, seqlen): groups repeated over their channels."""
    if M.dim() == 3:
        return M.unsqueeze(1)
    return M.repeat_interleave(dim // M.shape[1], dim=1)


def reference(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
              z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
              delta_softplus: bool) -> tuple[Tensor, Tensor]:
    """Selective scan in plain PyTorch (differentiable; exact in float64).  Returns (out, last_state)."""
    ct = state_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    d = u.shape[1]
    uc, dl = u.to(ct), delta.to(ct)
    if delta_bias is not None:
        dl = dl + delta_bias.to(ct).unsqueeze(-1)
    if delta_softplus:
        dl = F.softplus(dl)
    decay = torch.exp(dl.unsqueeze(2) * A.to(ct).unsqueeze(-1))            # (b, d, n, l)
    drive = (dl * uc).unsqueeze(2) * _per_channel(B.to(ct), d)             # (b, d, n, l)
    if initial_state is not None:  # fold h_{-1} into the first step's input
        first = drive[..., :1] + decay[..., :1] * initial_state.to(ct).unsqueeze(-1)
        drive = torch.cat([first, drive[..., 1:]], dim=-1)
    states = linear_scan(decay, drive)
    out = (states * _per_channel(C.to(ct), d)).sum(2)                      # (b, d, l)
    if D is not None:
        out = out + D.to(ct).unsqueeze(-1) * uc
    if z is not None:
        out = out * F.silu(z.to(ct))
    return out.to(u.dtype), states[..., -1]


@torch.library.custom_op("mambac::selective_scan", mutates_args=(), schema=SCHEMA)
def selective_scan_op(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                      z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor],
                      delta_softplus: bool) -> tuple[Tensor, Tensor]:
    out, last = reference(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus)
    return out.contiguous(), last.contiguous()


@selective_scan_op.register_fake
def _fake(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus):
    sd = state_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    return u.new_empty(u.shape), u.new_empty(u.shape[0], u.shape[1], A.shape[1], dtype=sd)


register_recompute_autograd(selective_scan_op, reference, n_outputs=2)

INFO = register_info(OpInfo(name=OP, op=torch.ops.mambac.selective_scan, reference=reference,
                            arg_names=ARG_NAMES, n_outputs=2, doc=__doc__ or ""))


def _check_bc(name: str, M: Tensor, b: int, d: int, n: int, l: int) -> None:
    """B / C: (batch, dstate, seqlen) shared by all channels, or (batch, ngroups, dstate, seqlen)."""
    if M.dim() == 3:
        check_shape(OP, name, M, (b, n, l))
        return
    check(M.dim() == 4, OP, f"{name} must be (batch, dstate, seqlen) or (batch, ngroups, dstate, seqlen), "
                            f"got shape {tuple(M.shape)}.")
    g = M.shape[1]
    check(g >= 1 and d % g == 0, OP, f"dim ({d}) must be a multiple of {name}'s ngroups ({g}).")
    check_shape(OP, name, M, (b, g, n, l))


def validate(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
             z: Optional[Tensor], delta_bias: Optional[Tensor], initial_state: Optional[Tensor]) -> None:
    """Raise a clear MambacInputError for anything the op cannot take."""
    check_float(OP, u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                initial_state=initial_state)
    check(u.dim() == 3, OP, f"u must be (batch, dim, seqlen), got shape {tuple(u.shape)}.")
    b, d, l = u.shape
    check(l >= 1, OP, "u needs a sequence length of at least 1.")
    check_shape(OP, "delta", delta, (b, d, l))
    check(A.dim() == 2, OP, f"A must be (dim, dstate), got shape {tuple(A.shape)}.")
    check_shape(OP, "A", A, (d, None))
    n = A.shape[1]
    _check_bc("B", B, b, d, n, l)
    _check_bc("C", C, b, d, n, l)
    check_shape(OP, "D", D, (d,))
    check_shape(OP, "z", z, (b, d, l))
    check_shape(OP, "delta_bias", delta_bias, (d,))
    check_shape(OP, "initial_state", initial_state, (b, d, n))


def selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                   z: Optional[Tensor] = None, delta_bias: Optional[Tensor] = None,
                   delta_softplus: bool = False, initial_state: Optional[Tensor] = None,
                   return_last_state: bool = False):
    """Mamba-1 selective scan over (batch, dim, seqlen); see the module docstring.

    Returns out, or (out, last_state) when ``return_last_state``.
    """
    if not isinstance(u, torch.fx.Proxy):
        validate(u, delta, A, B, C, D, z, delta_bias, initial_state)
    out, last = torch.ops.mambac.selective_scan(u, delta, A, B, C, D, z, delta_bias, initial_state,
                                                delta_softplus)
    return (out, last) if return_last_state else out
