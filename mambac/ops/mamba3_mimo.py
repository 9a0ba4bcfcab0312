"""``mambac::mamba3_mimo``: the Mamba-3 multi-input multi-output scan of rank r.

The MIMO variant keeps one state per head but writes and reads it through r channels: B and C
carry a rank axis, each head's value x is expanded to r values by a learned per-rank scale, and
the r outputs are gated and folded back into one.  With the SISO notation of
``mambac.ops.mamba3_siso`` (theta, lam, alpha, dt unchanged) and per-head parameters
mimo_x, mimo_z, mimo_o of shape (h, r, p):

    x (b, l, h, p); B, C (b, l, r, g, n); dt, adt, trap (b, l, h); angles (b, l, h, s), 2 * s <= n
    B_bias, C_bias (h, r, n); D (h,); z (b, l, h, p)

    v_tr = mimo_x_r * x_t                       (elementwise over p)
    k_tr = R(theta_t) (B_tr + B_bias_r),  q_tr = R(theta_t) (C_tr + C_bias_r)
    S_t = alpha_t S_{t-1} + (1 - lam_t) dt_t alpha_t sum_r outer(v_{t-1,r}, k_{t-1,r})
                          + lam_t dt_t sum_r outer(v_tr, k_tr)
    o_tr = (S_t q_tr + D v_tr) * silu(mimo_z_r * z_t)       (gate only when z is given)
    y_t = sum_r mimo_o_r * o_tr                              (when mimo_o is given)

Here R(theta) rotates the pairs (i, i + n/2), i < s (the "rotate-half" layout of the MIMO
kernels; SISO rotates adjacent pairs).  Without mimo_o the op returns the r outputs,
y (b, l, r, h, p), which is what a block does when it normalises each rank before folding.
z requires mimo_z.

The carried state is ``Mamba3State(angle, ssm, k, v)``: theta (b, h, s), S (b, h, p, n), the last
rotated, biased keys k (b, r, h, n) and the last *unexpanded* value x (b, h, p) (it is expanded by
mimo_x on use), the layout of mamba_ssm's Mamba-3 decoding cache.  Missing initial parts are
zeros; the final parts are always returned, fp32 (float64 for float64 x).

Returns ``(y, final_angle, final_ssm, final_k, final_v)``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, compute_dtype, register_info,
                                register_recompute_autograd)
from mambac.ops.mamba3_siso import (CARRIED, OUTPUT_NAMES, Mamba3State, as_state, check_groups,
                                    cumulative_angles, heads_from_groups, initial_or_zeros, rotate_halves,
                                    trapezoid_scan, validate_steps)


def _per_rank(param: Tensor, ct: torch.dtype) -> Tensor:
    """(h, r, p) per-head parameter -> (r, h, p), to broadcast against (b, l, r, h, p)."""
    return param.to(ct).transpose(0, 1)


def reference(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
              B_bias: Optional[Tensor], C_bias: Optional[Tensor], mimo_x: Tensor, mimo_z: Optional[Tensor],
              mimo_o: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
              initial_angle: Optional[Tensor], initial_ssm: Optional[Tensor], initial_k: Optional[Tensor],
              initial_v: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Plain-PyTorch Mamba-3 MIMO scan (chunked); see the module docstring."""
    ct = compute_dtype(x)
    b, _, h, p = x.shape
    r, n = B.shape[2], B.shape[-1]
    xc = x.to(ct)
    theta = cumulative_angles(angles, dt, initial_angle, ct)
    cos, sin = theta.cos().unsqueeze(2), theta.sin().unsqueeze(2)
    k = rotate_halves(heads_from_groups(B, None if B_bias is None else _per_rank(B_bias, ct), h, ct), cos, sin)
    q = rotate_halves(heads_from_groups(C, None if C_bias is None else _per_rank(C_bias, ct), h, ct), cos, sin)
    up = _per_rank(mimo_x, ct)
    v = xc.unsqueeze(2) * up
    v0 = initial_or_zeros(initial_v, (b, h, p), xc).unsqueeze(1) * up
    k0 = initial_or_zeros(initial_k, (b, r, h, n), xc)
    h0 = initial_or_zeros(initial_ssm, (b, h, p, n), xc)
    out, final = trapezoid_scan(q, k, v, adt.to(ct), dt.to(ct), torch.sigmoid(trap.to(ct)), k0, v0, h0,
                                chunk_size)
    if D is not None:
        out = out + D.to(ct)[:, None] * v
    if z is not None:
        out = out * F.silu(z.to(ct).unsqueeze(2) * _per_rank(mimo_z, ct))
    if mimo_o is not None:
        out = (out * _per_rank(mimo_o, ct)).sum(2)
    return out.to(x.dtype), theta[:, -1], final, k[:, -1], xc[:, -1]


@torch.library.custom_op("mambac::mamba3_mimo", mutates_args=())
def mamba3_mimo_op(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
                   B_bias: Optional[Tensor], C_bias: Optional[Tensor], mimo_x: Tensor, mimo_z: Optional[Tensor],
                   mimo_o: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
                   initial_angle: Optional[Tensor], initial_ssm: Optional[Tensor], initial_k: Optional[Tensor],
                   initial_v: Optional[Tensor], chunk_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    y, *states = reference(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, mimo_z, mimo_o, D, z,
                           initial_angle, initial_ssm, initial_k, initial_v, chunk_size)
    return (y.contiguous(), *(s.clone(memory_format=torch.contiguous_format) for s in states))


@mamba3_mimo_op.register_fake
def _fake(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, mimo_z, mimo_o, D, z, initial_angle,
          initial_ssm, initial_k, initial_v, chunk_size):
    b, l, h, p = x.shape
    r, n, s, sd = B.shape[2], B.shape[-1], angles.shape[-1], compute_dtype(x)
    y_shape = (b, l, h, p) if mimo_o is not None else (b, l, r, h, p)
    return (x.new_empty(y_shape), x.new_empty((b, h, s), dtype=sd), x.new_empty((b, h, p, n), dtype=sd),
            x.new_empty((b, r, h, n), dtype=sd), x.new_empty((b, h, p), dtype=sd))


register_recompute_autograd(mamba3_mimo_op, reference, n_outputs=5)

ARG_NAMES = ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o",
             "D", "z", "initial_angle", "initial_ssm", "initial_k", "initial_v", "chunk_size")

INFO = register_info(OpInfo(
    name="mamba3_mimo", op=torch.ops.mambac.mamba3_mimo, reference=reference, arg_names=ARG_NAMES,
    n_outputs=5, doc=__doc__ or "", extra={"output_names": OUTPUT_NAMES, "carried_state": dict(CARRIED)}))


def validate(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
             B_bias: Optional[Tensor], C_bias: Optional[Tensor], mimo_x: Tensor, mimo_z: Optional[Tensor],
             mimo_o: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor], state: Mamba3State,
             chunk_size: int) -> None:
    op = "mamba3_mimo"
    check_float(op, x=x, B=B, C=C, dt=dt, adt=adt, trap=trap, angles=angles, B_bias=B_bias, C_bias=C_bias,
                mimo_x=mimo_x, mimo_z=mimo_z, mimo_o=mimo_o, D=D, z=z, initial_angle=state.angle,
                initial_ssm=state.ssm, initial_k=state.k, initial_v=state.v)
    check(x.dim() == 4, op, f"x must be (batch, seqlen, heads, headdim), got shape {tuple(x.shape)}.")
    check(B.dim() == 5, op, f"B must be (batch, seqlen, rank, groups, dstate), got shape {tuple(B.shape)}.")
    check_shape(op, "B", B, (x.shape[0], x.shape[1], None, None, None))
    check_groups(op, B, C, x.shape[2])
    r, n = B.shape[2], B.shape[-1]
    check(n % 2 == 0, op, f"dstate must be even (its halves are rotated against each other), got {n}.")
    validate_steps(op, x, dt, adt, trap, angles, n, D, z, state, chunk_size)
    b, _, h, p = x.shape
    check_shape(op, "B_bias", B_bias, (h, r, n))
    check_shape(op, "C_bias", C_bias, (h, r, n))
    for name, t in (("mimo_x", mimo_x), ("mimo_z", mimo_z), ("mimo_o", mimo_o)):
        check_shape(op, name, t, (h, r, p))
    check(z is None or mimo_z is not None, op, "z is given but mimo_z is not; the gate needs both.")
    check(z is not None or mimo_z is None, op, "mimo_z is given without z; pass both or neither.")
    check_shape(op, "initial_state.k", state.k, (b, r, h, n))


def mamba3_mimo(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor, *,
                mimo_x: Tensor, B_bias: Optional[Tensor] = None, C_bias: Optional[Tensor] = None,
                mimo_z: Optional[Tensor] = None, mimo_o: Optional[Tensor] = None, D: Optional[Tensor] = None,
                z: Optional[Tensor] = None, initial_state: Optional[tuple] = None, chunk_size: int = 16,
                return_final_state: bool = False):
    """Mamba-3 MIMO scan; returns y, or ``(y, Mamba3State)`` with ``return_final_state``.

    y is (b, l, h, p) when mimo_o is given, else the per-rank outputs (b, l, r, h, p).
    See the module docstring for shapes and semantics.
    """
    state = as_state(initial_state)
    if not isinstance(x, torch.fx.Proxy):
        validate(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, mimo_z, mimo_o, D, z, state, chunk_size)
    out = torch.ops.mambac.mamba3_mimo(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, mimo_z,
                                             mimo_o, D, z, *state, chunk_size)
    # index rather than unpack: under fx tracing ``out`` is a Proxy, which cannot be iterated
    return (out[0], Mamba3State(out[1], out[2], out[3], out[4])) if return_final_state else out[0]
