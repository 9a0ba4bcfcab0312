"""``mambac::ssd``: the Mamba-2 state-space dual (SSD) scan, chunked.

Layout follows mamba_ssm's ``mamba_chunk_scan_combined``: x (batch, seqlen, heads, headdim), dt
(batch, seqlen, heads), A (heads,) (negative: a decay rate), B and C (batch, seqlen, groups, dstate)
with heads % groups == 0 (head i reads group i // (heads // groups)), D (heads,) or (heads, headdim),
z like x, dt_bias (heads,), initial_state (batch, heads, headdim, dstate).

Per head, with dt' = clamp(softplus(dt + dt_bias)) (each step optional) the op computes

    S_t = exp(dt'_t * A) * S_{t-1} + dt'_t * outer(x_t, B_t)        (S is headdim x dstate)
    y_t = S_t @ C_t + D * x_t,   then y_t *= silu(z_t) when z is given

and returns ``(y, final_state)`` where final_state = S_L.  y has x's dtype; the state and all decay
math are fp32 (float64 when an input is float64), so half inputs never accumulate in half.

The reference is the chunked algorithm that the generated kernels also follow: inside a chunk the
output is a masked (decay-weighted) attention-like product, each chunk summarises its input into a
state, the states are passed between chunks, and each chunk adds C times its incoming state.
Working in chunks keeps every exponent a sum of in-chunk decays (no cancellation of large cumsums).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, register_info,
                                register_recompute_autograd, state_dtype)

OP = "ssd"
SCHEMA = ("(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, "
          "Tensor? initial_state, int chunk_size, bool dt_softplus, float dt_min, float dt_max) "
          "-> (Tensor y, Tensor final_state)")
ARG_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state", "chunk_size",
             "dt_softplus", "dt_min", "dt_max")


def segsum(a: Tensor) -> Tensor:
    """Segment sums of per-step log-decays along the last dim: (..., T) -> (..., T, T).

    Entry [t, s] is sum(a[s+1 : t+1]) for t >= s (the log-decay from step s to step t) and -inf
    above the diagonal, so ``exp`` gives the causal decay matrix.  Each entry is summed directly
    rather than as a difference of cumulative sums, which would lose precision in fp32.
    """
    T = a.shape[-1]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    rows = a.unsqueeze(-1).expand(*a.shape, T)                     # [..., k, s] = a[k]
    sums = rows.masked_fill(~torch.tril(ones, -1), 0).cumsum(-2)   # [..., t, s] = sum_{s<k<=t} a[k]
    return sums.masked_fill(~torch.tril(ones), float("-inf"))


def process_dt(dt: Tensor, dt_bias: Optional[Tensor], softplus: bool, dt_min: float, dt_max: float,
               dtype: torch.dtype) -> Tensor:
    """dt' = clamp(softplus(dt + dt_bias)); each step only when asked for.  Shared with other ops."""
    d = dt.to(dtype)
    if dt_bias is not None:
        d = d + dt_bias.to(dtype)
    if softplus:
        d = F.softplus(d)  # threshold 20: identity above it, as in the upstream kernels
    if (dt_min, dt_max) != (0.0, math.inf):
        d = d.clamp(min=dt_min, max=dt_max)
    return d


def _chunked(t: Tensor, chunk: int) -> Tensor:
    """Zero-pad dim 1 (time) to a multiple of ``chunk`` and split it: (b, l, ...) -> (b, c, T, ...)."""
    pad = (-t.shape[1]) % chunk
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], t.shape[1] // chunk, chunk, *t.shape[2:])


def _pass_states(chunk_states: Tensor, chunk_logdecay: Tensor, init: Tensor) -> tuple[Tensor, Tensor]:
    """Inter-chunk recurrence, vectorised with a segment sum over chunks.

    chunk_states (b, c, g, r, p, n): what each chunk adds from a zero start; chunk_logdecay
    (b, c, g, r): each chunk's total log-decay; init (b, g, r, p, n).  Returns the state entering
    each chunk (b, c, g, r, p, n) and the final state (b, g, r, p, n).
    """
    logd = F.pad(chunk_logdecay.permute(0, 2, 3, 1), (1, 0))          # (b, g, r, c+1)
    decay = torch.exp(segsum(logd))                                    # (b, g, r, c+1, c+1)
    stacked = torch.cat([init.unsqueeze(1), chunk_states], dim=1)      # (b, c+1, g, r, p, n)
    after = torch.einsum("bgrij,bjgrpn->bigrpn", decay, stacked)      # state after chunk i-1
    return after[:, :-1], after[:, -1]


def reference(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
              z: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor],
              chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[Tensor, Tensor]:
    """Chunked SSD in plain PyTorch (differentiable; exact in float64).  Returns (y, final_state)."""
    ct = state_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    r, T = h // g, min(chunk_size, l)  # a chunk longer than the sequence only adds padding
    dtp = _chunked(process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, ct), T)   # (b, c, T, h)
    xs = _chunked(x.to(ct), T).unflatten(3, (g, r))                               # (b, c, T, g, r, p)
    Bs, Cs = _chunked(B.to(ct), T), _chunked(C.to(ct), T)                          # (b, c, T, g, n)
    dts = dtp.unflatten(3, (g, r)).permute(0, 1, 3, 4, 2)                         # (b, c, g, r, T)
    logd = dts * A.to(ct).reshape(g, r, 1)
    decay = torch.exp(segsum(logd))                                                # (b, c, g, r, T, T)
    # Intra-chunk output: y_t = sum_{s<=t} (C_t . B_s) * decay[t, s] * dt_s * x_s.
    cb = torch.einsum("bctgn,bcsgn->bcgts", Cs, Bs).unsqueeze(3)
    y = torch.einsum("bcgrts,bcsgrp->bctgrp", cb * decay * dts.unsqueeze(-2), xs)
    # Chunk summaries: inputs decayed to the chunk's end (the last row of the decay matrix).
    weights = (decay[..., -1, :] * dts).permute(0, 1, 4, 2, 3).unsqueeze(-1)       # (b, c, T, g, r, 1)
    states = torch.einsum("bcsgrp,bcsgn->bcgrpn", xs * weights, Bs)
    init = xs.new_zeros(b, g, r, p, n) if initial_state is None else initial_state.to(ct).reshape(b, g, r, p, n)
    incoming, final = _pass_states(states, logd.sum(-1), init)
    # Contribution of the incoming state, decayed from the chunk start to step t (inclusive).
    start_decay = torch.exp(logd.cumsum(-1)).permute(0, 1, 4, 2, 3).unsqueeze(-1)  # (b, c, T, g, r, 1)
    y = y + torch.einsum("bctgn,bcgrpn->bctgrp", Cs, incoming) * start_decay
    y = y.reshape(b, -1, h, p)[:, :l]
    return _epilogue(y, x, D, z, ct).to(x.dtype), final.reshape(b, h, p, n)


def _epilogue(y: Tensor, x: Tensor, D: Optional[Tensor], z: Optional[Tensor], ct: torch.dtype) -> Tensor:
    """Skip connection D*x (D per head or per (head, headdim)) and the silu(z) gate."""
    if D is not None:
        Dc = D.to(ct)
        y = y + x.to(ct) * (Dc.unsqueeze(-1) if Dc.dim() == 1 else Dc)
    if z is not None:
        y = y * F.silu(z.to(ct))
    return y


@torch.library.custom_op("mambac::ssd", mutates_args=(), schema=SCHEMA)
def ssd_op(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
           z: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor],
           chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float) -> tuple[Tensor, Tensor]:
    y, final = reference(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus,
                         dt_min, dt_max)
    return y.contiguous(), final.contiguous()


@ssd_op.register_fake
def _fake(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus, dt_min, dt_max):
    sd = state_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    b, _, h, p = x.shape
    return x.new_empty(x.shape), x.new_empty(b, h, p, B.shape[-1], dtype=sd)


register_recompute_autograd(ssd_op, reference, n_outputs=2)

INFO = register_info(OpInfo(name=OP, op=torch.ops.mambac.ssd, reference=reference, arg_names=ARG_NAMES,
                            n_outputs=2, doc=__doc__ or ""))


def validate(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
             z: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor],
             chunk_size: int, dt_limit: tuple[float, float]) -> None:
    """Raise a clear MambacInputError for anything the op cannot take."""
    check_float(OP, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_state=initial_state)
    check(x.dim() == 4, OP, f"x must be (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}.")
    b, l, h, p = x.shape
    check(l >= 1, OP, "x needs a sequence length of at least 1.")
    check(B.dim() == 4, OP, f"B must be (batch, seqlen, ngroups, dstate), got shape {tuple(B.shape)}.")
    g, n = B.shape[2], B.shape[3]
    check(g >= 1 and h % g == 0, OP, f"the number of heads ({h}) must be a multiple of ngroups ({g}).")
    check_shape(OP, "B", B, (b, l, g, n))
    check_shape(OP, "C", C, (b, l, g, n))
    check_shape(OP, "dt", dt, (b, l, h))
    check_shape(OP, "A", A, (h,))
    check(D is None or tuple(D.shape) in ((h,), (h, p)), OP,
          f"D must have shape ({h},) or ({h}, {p}), got {None if D is None else tuple(D.shape)}.")
    check_shape(OP, "z", z, (b, l, h, p))
    check_shape(OP, "dt_bias", dt_bias, (h,))
    check_shape(OP, "initial_state", initial_state, (b, h, p, n))
    check(isinstance(chunk_size, (int, torch.SymInt)) and not isinstance(chunk_size, bool) and chunk_size > 0, OP,
          lambda: f"chunk_size must be a positive int, got {chunk_size!r}.")
    check(len(dt_limit) == 2 and dt_limit[0] <= dt_limit[1], OP,
          lambda: f"dt_limit must be a (min, max) pair with min <= max, got {dt_limit!r}.")


def ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 256,
        D: Optional[Tensor] = None, z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
        dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
        initial_state: Optional[Tensor] = None, return_final_state: bool = False):
    """Mamba-2 SSD scan over (batch, seqlen, heads, headdim); see the module docstring.

    Returns y, or (y, final_state) when ``return_final_state``.
    """
    if not isinstance(x, torch.fx.Proxy):
        validate(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_limit)
    dt_min, dt_max = float(dt_limit[0]), float(dt_limit[1])
    y, final = torch.ops.mambac.ssd(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size,
                                    dt_softplus, dt_min, dt_max)
    return (y, final) if return_final_state else y
