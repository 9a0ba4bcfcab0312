"""Float64 referees for the recurrent scans: the recurrences one step at a time (no chunks, no
prefix scans), independent of the ops' own references."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def selective_scan_referee(u, delta, A, B, C, D, z, delta_bias, init, softplus):
    """h_t = exp(d_t A) h_{t-1} + d_t u_t B_t;  out_t = (C_t . h_t + D u_t) silu(z_t)."""
    b, d, l = u.shape
    d_ = delta + delta_bias[:, None] if delta_bias is not None else delta
    d_ = F.softplus(d_) if softplus else d_
    Bc = B.unsqueeze(1) if B.dim() == 3 else B.repeat_interleave(d // B.shape[1], dim=1)
    Cc = C.unsqueeze(1) if C.dim() == 3 else C.repeat_interleave(d // C.shape[1], dim=1)
    h = u.new_zeros(b, d, A.shape[1]) if init is None else init
    outs = []
    for t in range(l):
        h = torch.exp(d_[:, :, t, None] * A) * h + (d_[:, :, t] * u[:, :, t])[..., None] * Bc[..., t]
        outs.append((h * Cc[..., t]).sum(-1))
    out = torch.stack(outs, -1)
    if D is not None:
        out = out + D[:, None] * u
    if z is not None:
        out = out * F.silu(z)
    return out, h


def _rotate_pairs(v, theta):
    """Rotate (v[2i], v[2i+1]) by theta[i] for i < theta.shape[-1]."""
    s = theta.shape[-1]
    a, b = v[..., 0:2 * s:2], v[..., 1:2 * s:2]
    c, sn = torch.cos(theta), torch.sin(theta)
    out = v.clone()
    out[..., 0:2 * s:2] = a * c - b * sn
    out[..., 1:2 * s:2] = a * sn + b * c
    return out


def mamba3_siso_referee(x, B, C, dt, adt, trap, angles, B_bias, C_bias, D, z, ia, iss, ik, iv):
    """The Mamba-3 SISO recurrence of ``mambac.ops.mamba3_siso``'s docstring, step by step."""
    b, l, h, p = x.shape
    g, n, s = B.shape[2], B.shape[3], angles.shape[3]
    Bh = B.repeat_interleave(h // g, dim=2) + (0 if B_bias is None else B_bias)
    Ch = C.repeat_interleave(h // g, dim=2) + (0 if C_bias is None else C_bias)
    theta = x.new_zeros(b, h, s) if ia is None else ia
    S = x.new_zeros(b, h, p, n) if iss is None else iss
    kp = x.new_zeros(b, h, n) if ik is None else ik
    vp = x.new_zeros(b, h, p) if iv is None else iv
    ys = []
    for t in range(l):
        theta = theta + math.pi * torch.tanh(angles[:, t]) * dt[:, t, :, None]
        k, q = _rotate_pairs(Bh[:, t], theta), _rotate_pairs(Ch[:, t], theta)
        alpha, lam = torch.exp(adt[:, t]), torch.sigmoid(trap[:, t])
        beta, gamma = ((1 - lam) * dt[:, t] * alpha)[..., None, None], (lam * dt[:, t])[..., None, None]
        S = alpha[..., None, None] * S + beta * vp[..., None] * kp[..., None, :] \
            + gamma * x[:, t, ..., None] * k[..., None, :]
        ys.append((S * q[..., None, :]).sum(-1))
        kp, vp = k, x[:, t]
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + D[:, None] * x
    if z is not None:
        y = y * F.silu(z)
    wrapped = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
    return y, wrapped, S, kp, vp


def _rotate_halves(v, theta):
    """Rotate (v[i], v[n/2 + i]) by theta[i] for i < theta.shape[-1]."""
    s, half = theta.shape[-1], v.shape[-1] // 2
    a, b = v[..., :s], v[..., half:half + s]
    c, sn = torch.cos(theta), torch.sin(theta)
    out = v.clone()
    out[..., :s] = a * c - b * sn
    out[..., half:half + s] = a * sn + b * c
    return out


def mamba3_mimo_referee(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, mimo_z, mimo_o, D, z,
                        ia, iss, ik, iv):
    """The Mamba-3 MIMO recurrence of ``mambac.ops.mamba3_mimo``'s docstring, step by step."""
    b, l, h, p = x.shape
    r, g, n, s = B.shape[2], B.shape[3], B.shape[4], angles.shape[3]
    Bh = B.repeat_interleave(h // g, dim=3) + (0 if B_bias is None else B_bias.transpose(0, 1))
    Ch = C.repeat_interleave(h // g, dim=3) + (0 if C_bias is None else C_bias.transpose(0, 1))
    ux = mimo_x.transpose(0, 1)                                        # (r, h, p)
    theta = x.new_zeros(b, h, s) if ia is None else ia
    S = x.new_zeros(b, h, p, n) if iss is None else iss
    kp = x.new_zeros(b, r, h, n) if ik is None else ik
    xp = x.new_zeros(b, h, p) if iv is None else iv
    ys = []
    for t in range(l):
        theta = theta + math.pi * torch.tanh(angles[:, t]) * dt[:, t, :, None]
        k = _rotate_halves(Bh[:, t], theta.unsqueeze(1))               # (b, r, h, n)
        q = _rotate_halves(Ch[:, t], theta.unsqueeze(1))
        alpha, lam = torch.exp(adt[:, t]), torch.sigmoid(trap[:, t])
        beta, gamma = ((1 - lam) * dt[:, t] * alpha)[..., None, None], (lam * dt[:, t])[..., None, None]
        v, vp = x[:, t].unsqueeze(1) * ux, xp.unsqueeze(1) * ux       # (b, r, h, p)
        S = alpha[..., None, None] * S + beta * torch.einsum("brhp,brhn->bhpn", vp, kp) \
            + gamma * torch.einsum("brhp,brhn->bhpn", v, k)
        o = torch.einsum("bhpn,brhn->brhp", S, q)
        if D is not None:
            o = o + D[:, None] * v
        if z is not None:
            o = o * F.silu(z[:, t].unsqueeze(1) * mimo_z.transpose(0, 1))
        ys.append((o * mimo_o.transpose(0, 1)).sum(1) if mimo_o is not None else o)
        kp, xp = k, x[:, t]
    y = torch.stack(ys, 1)
    wrapped = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
    return y, wrapped, S, kp, xp
