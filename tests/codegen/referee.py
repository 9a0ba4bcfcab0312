"""A float64 referee for the SSD op: the recurrence itself, one step at a time (no chunks)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_referee(x, dt, A, B, C, D, z, dt_bias, init, softplus, dt_min, dt_max):
    """S_t = exp(dt'_t A) S_{t-1} + dt'_t x_t B_t^T ;  y_t = S_t C_t + D x_t ;  y *= silu(z)."""
    b, l, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    d = dt + dt_bias if dt_bias is not None else dt
    d = F.softplus(d) if softplus else d
    if (dt_min, dt_max) != (0.0, float("inf")):
        d = d.clamp(dt_min, dt_max)
    Bh = B.repeat_interleave(h // g, dim=2)
    Ch = C.repeat_interleave(h // g, dim=2)
    S = x.new_zeros(b, h, p, n) if init is None else init
    ys = []
    for t in range(l):
        decay = torch.exp(d[:, t] * A)[..., None, None]
        S = decay * S + (d[:, t, :, None, None] * x[:, t, :, :, None]) * Bh[:, t, :, None, :]
        ys.append((S * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * F.silu(z)
    return y, S


def check_grads(errs: dict, names, grads, args, refs, tol: float) -> None:
    """Add each input gradient's relative error (against ``ref.grad``) to ``errs`` and assert every
    error is within ``tol``; an absent input must get no gradient."""
    from tests.helpers import rel_err
    for name, g, a, ref in zip(names, grads, args, refs):
        if a is None:
            assert g is None, name
            continue
        assert g.shape == a.shape and g.dtype == a.dtype, name
        errs["d" + name] = rel_err(g, ref.grad)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"errors above {tol}: {bad}; all: {errs}"
