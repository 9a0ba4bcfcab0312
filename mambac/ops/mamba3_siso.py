"""``mambac::mamba3_siso``: the Mamba-3 single-input single-output scan, and the machinery it
shares with ``mambac::mamba3_mimo``.

Mamba-3 replaces Mamba-2's Euler step by an exponential-trapezoidal one (each step mixes the
current and the previous input), makes the decay data dependent, and rotates B and C by
data-dependent cumulative angles (a "RoPE" whose speed is learned per token).  Layout follows
the Mamba-3 module of mamba_ssm, with the time axis at dim 1 of every per-step tensor:

    x (b, l, h, p)      values, one head of width p per head
    B, C (b, l, g, n)   keys and queries, h % g == 0 (head i reads group i // (h // g))
    dt (b, l, h)        positive step sizes (softplus already applied)
    adt (b, l, h)       log-decay per step, A * dt (negative)
    trap (b, l, h)      trapezoid mixing logits (sigmoid is applied inside)
    angles (b, l, h, s) raw rotation rates, 2 * s <= n (tanh * pi is applied inside)
    B_bias, C_bias (h, n), D (h,), z (b, l, h, p): optional

Per batch element and head, with lam_t = sigmoid(trap_t) and alpha_t = exp(adt_t):

    theta_t = (theta_{t-1} + pi * tanh(angles_t) * dt_t) mod 2 pi
    k_t = R(theta_t) (B_t + B_bias),   q_t = R(theta_t) (C_t + C_bias)
    S_t = alpha_t S_{t-1} + (1 - lam_t) dt_t alpha_t * outer(x_{t-1}, k_{t-1}) + lam_t dt_t * outer(x_t, k_t)
    y_t = (S_t q_t + D x_t) * silu(z_t)

R(theta) rotates the adjacent pairs (2i, 2i+1), i < s, by theta_i (pairs past s pass through).
The carried state is ``Mamba3State(angle, ssm, k, v)``: theta (b, h, s), S (b, h, p, n), the last
rotated, biased key k (b, h, n) and the last value x (b, h, p).  Each initial part is optional
(zeros when absent) and the op always returns the final parts, so running a sequence in two
pieces, the second starting from the first's final state, equals running it whole (what decoding
and context parallelism rely on).  States are fp32 (float64 for float64 x); y has x's dtype.

Returns ``(y, final_angle, final_ssm, final_k, final_v)``.  The reference turns the trapezoid into
a plain linear scan with twice the rank (step t reads the pair (k_{t-1}, x_{t-1}) weighted by
(1 - lam_t) dt_t alpha_t next to (k_t, x_t) weighted by lam_t dt_t) and runs it in chunks.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, compute_dtype,
                                register_info, register_recompute_autograd)

TWO_PI = 2.0 * math.pi


class Mamba3State(NamedTuple):
    """What a Mamba-3 scan carries from one segment to the next (see the module docstring)."""

    angle: Optional[Tensor]
    ssm: Optional[Tensor]
    k: Optional[Tensor]
    v: Optional[Tensor]


# ---------------------------------------------------------------------------------------------
# shared math (also used by mamba3_mimo)
# ---------------------------------------------------------------------------------------------

def cumulative_angles(angles: Tensor, dt: Tensor, initial: Optional[Tensor], ct: torch.dtype) -> Tensor:
    """theta_t = (theta_init + sum_{u<=t} pi * tanh(angles_u) * dt_u) mod 2 pi, shape (b, l, h, s).

    Wrapping keeps the angle small so cos/sin stay accurate; floor has zero gradient, so the
    derivative is that of the unwrapped sum.
    """
    theta = torch.cumsum(math.pi * torch.tanh(angles.to(ct)) * dt.to(ct).unsqueeze(-1), dim=1)
    if initial is not None:
        theta = theta + initial.to(ct).unsqueeze(1)
    return theta - TWO_PI * torch.floor(theta / TWO_PI)


def rotate_adjacent(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (t[2i], t[2i+1]), i < s = cos.shape[-1], by angle i (SISO convention)."""
    s = cos.shape[-1]
    pairs = t[..., : 2 * s].unflatten(-1, (s, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    turned = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([turned, t[..., 2 * s:]], dim=-1)


def rotate_halves(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (t[i], t[i + n/2]), i < s = cos.shape[-1], by angle i (MIMO convention)."""
    half, s = t.shape[-1] // 2, cos.shape[-1]
    a, b = t[..., :s], t[..., half: half + s]
    return torch.cat([a * cos - b * sin, t[..., s:half], a * sin + b * cos, t[..., half + s:]], dim=-1)


def heads_from_groups(t: Tensor, bias: Optional[Tensor], nheads: int, ct: torch.dtype) -> Tensor:
    """Broadcast group-shared B or C (group axis at dim -2) to every head and add the per-head bias."""
    out = t.to(ct).repeat_interleave(nheads // t.shape[-2], dim=-2)
    return out if bias is None else out + bias.to(ct)


def segsum(a: Tensor) -> Tensor:
    """(..., T, h) per-step log-decays -> (..., T, T, h) with [t, s] = sum(a[s+1 : t+1]) for s <= t,
    -inf above the diagonal.  Summed directly (not as a difference of cumsums) for fp32 accuracy."""
    T = a.shape[-2]
    ones = torch.ones(T, T, dtype=torch.bool, device=a.device)
    rows = a.unsqueeze(-2).expand(*a.shape[:-1], T, a.shape[-1])            # [.., k, s, h] = a[k]
    sums = rows.masked_fill(~torch.tril(ones, -1).unsqueeze(-1), 0).cumsum(-3)  # [t, s] = sum_{s<k<=t}
    return sums.masked_fill(~torch.tril(ones).unsqueeze(-1), float("-inf"))


def _chunks(t: Tensor, T: int) -> Tensor:
    """Zero-pad time (dim 1) to a multiple of T and split it: (b, l, ...) -> (b, l / T, T, ...)."""
    pad = (-t.shape[1]) % T
    if pad:
        t = torch.cat([t, t.new_zeros((t.shape[0], pad) + tuple(t.shape[2:]))], dim=1)
    return t.unflatten(1, (t.shape[1] // T, T))


def chunked_linear_scan(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, h0: Tensor,
                        chunk_size: int) -> tuple[Tensor, Tensor]:
    """S_t = exp(log_decay_t) S_{t-1} + sum_j outer(v_tj, k_tj);  out_tr = S_t q_tr.

    q (b, l, r, h, n), k (b, l, j, h, n), v (b, l, j, h, p), log_decay (b, l, h), h0 (b, h, p, n).
    Returns out (b, l, r, h, p) and S_L.  Padded steps have zero decay and zero input, so the
    state after the last (padded) chunk is S_L.
    """
    L = q.shape[1]
    T = max(1, min(chunk_size, L))
    qc, kc, vc, ac = (_chunks(t, T) for t in (q, k, v, log_decay))
    cum = ac.cumsum(2)                                             # (b, c, T, h)
    decay = segsum(ac).exp()                                       # (b, c, t, s, h)
    scores = torch.einsum("bctrhn,bcsjhn->bctsrjh", qc, kc) * decay[:, :, :, :, None, None, :]
    intra = torch.einsum("bctsrjh,bcsjhp->bctrhp", scores, vc)
    to_end = decay[:, :, -1]                                       # decay from s to the chunk end
    local = torch.einsum("bcsh,bcsjhp,bcsjhn->bchpn", to_end, vc, kc)
    state, entering = h0, []
    for i in range(local.shape[1]):
        entering.append(state)
        state = cum[:, i, -1, :, None, None].exp() * state + local[:, i]
    inter = torch.einsum("bctrhn,bchpn->bctrhp", qc, torch.stack(entering, 1))
    out = intra + inter * cum.exp()[:, :, :, None, :, None]
    return out.flatten(1, 2)[:, :L], state


def trapezoid_scan(q: Tensor, k: Tensor, v: Tensor, adt: Tensor, dt: Tensor, lam: Tensor,
                   k0: Tensor, v0: Tensor, h0: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The Mamba-3 recurrence for rank-r keys/values; shapes as in ``chunked_linear_scan`` with
    k0 (b, r, h, n), v0 (b, r, h, p) the pair preceding step 0.  Step t's input is
    (1 - lam_t) dt_t alpha_t * outer(v_{t-1}, k_{t-1}) + lam_t dt_t * outer(v_t, k_t)."""
    alpha = adt.exp()
    beta = ((1 - lam) * dt * alpha)[:, :, None, :, None]
    gamma = (lam * dt)[:, :, None, :, None]
    k_prev = torch.cat([k0.unsqueeze(1), k[:, :-1]], dim=1)
    v_prev = torch.cat([v0.unsqueeze(1), v[:, :-1]], dim=1)
    keys = torch.cat([k_prev * beta, k * gamma], dim=2)
    values = torch.cat([v_prev, v], dim=2)
    return chunked_linear_scan(q, keys, values, adt, h0, chunk_size)


def initial_or_zeros(t: Optional[Tensor], shape: tuple, like: Tensor) -> Tensor:
    return like.new_zeros(shape) if t is None else t.to(like.dtype)


# ---------------------------------------------------------------------------------------------
# the SISO op
# ---------------------------------------------------------------------------------------------

def reference(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
              B_bias: Optional[Tensor], C_bias: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
              initial_angle: Optional[Tensor], initial_ssm: Optional[Tensor], initial_k: Optional[Tensor],
              initial_v: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Plain-PyTorch Mamba-3 SISO scan (chunked); see the module docstring."""
    ct = compute_dtype(x)
    b, _, h, p = x.shape
    n = B.shape[-1]
    xc = x.to(ct)
    theta = cumulative_angles(angles, dt, initial_angle, ct)
    cos, sin = theta.cos(), theta.sin()
    k = rotate_adjacent(heads_from_groups(B, B_bias, h, ct), cos, sin)
    q = rotate_adjacent(heads_from_groups(C, C_bias, h, ct), cos, sin)
    k0 = initial_or_zeros(initial_k, (b, h, n), xc)
    v0 = initial_or_zeros(initial_v, (b, h, p), xc)
    h0 = initial_or_zeros(initial_ssm, (b, h, p, n), xc)
    out, final = trapezoid_scan(q.unsqueeze(2), k.unsqueeze(2), xc.unsqueeze(2), adt.to(ct), dt.to(ct),
                                torch.sigmoid(trap.to(ct)), k0.unsqueeze(1), v0.unsqueeze(1), h0, chunk_size)
    y = out.squeeze(2)
    if D is not None:
        y = y + D.to(ct)[:, None] * xc
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(ct))
    return y.to(x.dtype), theta[:, -1], final, k[:, -1], xc[:, -1]


@torch.library.custom_op("mambac::mamba3_siso", mutates_args=())
def mamba3_siso_op(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
                   B_bias: Optional[Tensor], C_bias: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
                   initial_angle: Optional[Tensor], initial_ssm: Optional[Tensor], initial_k: Optional[Tensor],
                   initial_v: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, *states = reference(x, B, C, dt, adt, trap, angles, B_bias, C_bias, D, z, initial_angle, initial_ssm,
                           initial_k, initial_v, chunk_size)
    return (y.contiguous(), *(s.clone(memory_format=torch.contiguous_format) for s in states))


@mamba3_siso_op.register_fake
def _fake(x, B, C, dt, adt, trap, angles, B_bias, C_bias, D, z, initial_angle, initial_ssm, initial_k,
          initial_v, chunk_size):
    b, _, h, p = x.shape
    n, s, sd = B.shape[-1], angles.shape[-1], compute_dtype(x)
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((b, h, s), dtype=sd),
            x.new_empty((b, h, p, n), dtype=sd), x.new_empty((b, h, n), dtype=sd),
            x.new_empty((b, h, p), dtype=sd))


register_recompute_autograd(mamba3_siso_op, reference, n_outputs=5)

ARG_NAMES = ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias", "D", "z", "initial_angle",
             "initial_ssm", "initial_k", "initial_v", "chunk_size")
OUTPUT_NAMES = ("y", "final_angle", "final_ssm", "final_k", "final_v")
CARRIED = {"initial_angle": "final_angle", "initial_ssm": "final_ssm", "initial_k": "final_k",
           "initial_v": "final_v"}

INFO = register_info(OpInfo(
    name="mamba3_siso", op=torch.ops.mambac.mamba3_siso, reference=reference, arg_names=ARG_NAMES,
    n_outputs=5, doc=__doc__ or "", extra={"output_names": OUTPUT_NAMES, "carried_state": CARRIED}))


# ---------------------------------------------------------------------------------------------
# validation (the per-step part is shared with mamba3_mimo)
# ---------------------------------------------------------------------------------------------

def validate_steps(op: str, x: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor, n: int,
                   D: Optional[Tensor], z: Optional[Tensor], state: Mamba3State, chunk_size: int) -> None:
    """Checks common to both Mamba-3 ops: everything but B, C, their biases and the k state."""
    check(x.dim() == 4, op, f"x must be (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}.")
    b, l, h, p = x.shape
    check(l >= 1, op, "the sequence is empty (seqlen 0).")
    for name, t in (("dt", dt), ("adt", adt), ("trap", trap)):
        check_shape(op, name, t, (b, l, h))
    check(angles.dim() == 4, op, f"angles must be (batch, seqlen, heads, n_angles), got {tuple(angles.shape)}.")
    check_shape(op, "angles", angles, (b, l, h, None))
    s = angles.shape[-1]
    check(2 * s <= n, op, f"{s} angles need 2 * {s} <= dstate, but dstate is {n}.")
    check_shape(op, "D", D, (h,))
    check_shape(op, "z", z, (b, l, h, p))
    check_shape(op, "initial_state.angle", state.angle, (b, h, s))
    check_shape(op, "initial_state.ssm", state.ssm, (b, h, p, n))
    check_shape(op, "initial_state.v", state.v, (b, h, p))
    check(isinstance(chunk_size, int) and chunk_size >= 1, op,
          f"chunk_size must be a positive int, got {chunk_size!r}.")


def check_groups(op: str, B: Tensor, C: Tensor, nheads: int) -> None:
    check(B.shape == C.shape, op, f"B {tuple(B.shape)} and C {tuple(C.shape)} must have the same shape.")
    g = B.shape[-2]
    check(g >= 1 and nheads % g == 0, op, f"heads ({nheads}) must be a multiple of groups ({g}).")


def as_state(initial_state: Optional[tuple]) -> Mamba3State:
    if initial_state is None:
        return Mamba3State(None, None, None, None)
    return Mamba3State(*initial_state)


def validate(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
             B_bias: Optional[Tensor], C_bias: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
             state: Mamba3State, chunk_size: int) -> None:
    op = "mamba3_siso"
    check_float(op, x=x, B=B, C=C, dt=dt, adt=adt, trap=trap, angles=angles, B_bias=B_bias, C_bias=C_bias,
                D=D, z=z, initial_angle=state.angle, initial_ssm=state.ssm, initial_k=state.k,
                initial_v=state.v)
    check(x.dim() == 4, op, f"x must be (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}.")
    check(B.dim() == 4, op, f"B must be (batch, seqlen, groups, dstate), got shape {tuple(B.shape)}.")
    check_shape(op, "B", B, (x.shape[0], x.shape[1], None, None))
    check_groups(op, B, C, x.shape[2])
    n = B.shape[-1]
    validate_steps(op, x, dt, adt, trap, angles, n, D, z, state, chunk_size)
    h = x.shape[2]
    check_shape(op, "B_bias", B_bias, (h, n))
    check_shape(op, "C_bias", C_bias, (h, n))
    check_shape(op, "initial_state.k", state.k, (x.shape[0], h, n))


def mamba3_siso(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor, *,
                B_bias: Optional[Tensor] = None, C_bias: Optional[Tensor] = None, D: Optional[Tensor] = None,
                z: Optional[Tensor] = None, initial_state: Optional[tuple] = None, chunk_size: int = 64,
                return_final_state: bool = False):
    """Mamba-3 SISO scan; returns y, or ``(y, Mamba3State)`` with ``return_final_state``.

    ``initial_state`` is a ``Mamba3State`` (or a 4-tuple angle, ssm, k, v; entries may be None).
    See the module docstring for shapes and semantics.
    """
    state = as_state(initial_state)
    if not isinstance(x, torch.fx.Proxy):
        validate(x, B, C, dt, adt, trap, angles, B_bias, C_bias, D, z, state, chunk_size)
    out = torch.ops.mambac.mamba3_siso(x, B, C, dt, adt, trap, angles, B_bias, C_bias, D, z, *state,
                                             chunk_size)
    # index rather than unpack: under fx tracing ``out`` is a Proxy, which cannot be iterated
    return (out[0], Mamba3State(out[1], out[2], out[3], out[4])) if return_final_state else out[0]
