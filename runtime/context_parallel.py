"""Context-parallel forms of the sequence ops: the sequence dimension split over ``world`` ranks.

Rank r holds tokens ``[split_start(L, world, r), ...)`` of every sequence (``split_sizes``: the
first ranks take one more when ``world`` does not divide ``L``).  Per-token ops need nothing; the
ops that look back along the sequence need what the earlier ranks saw:

- ``cp_causal_conv1d``: a halo.  Every rank publishes the last ``width - 1`` inputs it holds; rank
  r's conv starts from the last ``width - 1`` inputs of ranks ``0..r-1`` (zeros on rank 0) through
  the op's ``initial_state``.  Ranks shorter than the halo are handled (the halo then spans ranks).
- ``cp_ssd`` / ``cp_selective_scan`` / ``cp_mamba3_siso`` / ``cp_mamba3_mimo``: state passing.
  Each rank scans its piece from a zero state, giving its final state S_j and the total log-decay
  of its piece (fp32).  One all-gather of these summaries (size independent of L) and a local
  exclusive prefix combine
  ``S_in(r) = sum_{j<r} exp(ld_{j+1} + ... + ld_{r-1}) S_j`` give rank r its incoming state.
  SSD on generated kernels (``cp_ssd_fused`` in ``cp_ssd_fused.py``) is the plain SSD of the piece
  from ``S_in`` with the exchange inside it: the states from zero (the summary), then one fold
  of ``S_in`` into the per-chunk states (they are linear in it); in the backward one fold of the
  later ranks' final-state gradient into the per-chunk state gradients.  SSD elsewhere
  (PyTorch, float64) corrects its zero-start output, y += exp(cum_t) C_t S_in
  (``cp_ssd_corrected``); the other scans run a second pass of the piece from ``S_in``
  (exact by construction: it is the op itself, with its initial state; it doubles their compute).
  Mamba-3 carries angle, ssm state, last key and last value: ``_mamba3_incoming`` composes them
  (angles add, keys and states rotate by the incoming angle, the pair before a piece's first step
  enters its state with weight (1 - lam_0) dt_0).

Every exchange is ``mambac.all_gather_rs``: gather forward, reduce-scatter backward, which is the
right gradient when each rank uses the gathered pieces differently (the gradient for rank j's
piece is the sum of what every rank's use of it contributed), so autograd runs backward through
the same exchange in reverse.  (``cp_ssd_fused`` instead all-gathers twice, inside its forward and
its backward: the summaries, then every rank's incoming-state gradient, from which each rank sums
what the later ranks send back to it.)  Each form returns what its op returns, for this rank's piece:
the output and this rank's final state (the last rank's is the whole sequence's final state).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import mambac.ops  # noqa: F401  (registers torch.ops.mambac scan ops)
from mambac.errors import MambacInputError
from mambac.runtime.collectives import split_sizes, split_start


def local_piece(t: Tensor, dim: int, rank: int, world: int) -> Tensor:
    """This rank's piece of the full sequence ``t`` along ``dim`` (uneven split allowed)."""
    n = t.shape[dim]
    if n < world:
        raise MambacInputError(f"context parallelism over {world} ranks needs a sequence of at least {world} "
                               f"tokens, got {n}.")
    return t.narrow(dim, split_start(n, world, rank), split_sizes(n, world)[rank])


def exchange(summary: Tensor, rank: int, world: int, group: str) -> Tensor:
    """Every rank's ``summary`` stacked along a new first dim (same shape on every rank)."""
    return torch.ops.mambac.all_gather_rs(summary.unsqueeze(0).contiguous(), 0, world, rank, world, group)


def anchored(result: Tensor, gathered: Tensor) -> Tensor:
    """``result`` made to depend on ``gathered`` even where it reads none of it (rank 0).

    Every rank must run the exchange's backward reduce-scatter, or the ranks' collectives stop
    matching; adding an empty sum keeps the exchange in every rank's autograd graph for free."""
    return result + gathered.narrow(0, 0, 0).sum().to(result.dtype)


def _state_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def prefix_weights(log_decays: Tensor, rank: int) -> Tensor:
    """(rank, *D): the weight exp(ld_{j+1} + ... + ld_{rank-1}) of rank j's final state in the
    incoming state of ``rank``; sums of later decays (a reversed cumsum), never differences."""
    lds = log_decays[:rank]
    return torch.exp(torch.cat([lds[1:], torch.zeros_like(lds[:1])]).flip(0).cumsum(0).flip(0))


def incoming_state(states: Tensor, log_decays: Tensor, rank: int) -> Tensor:
    """Exclusive prefix combine of per-rank (final state from zero, total log-decay) pairs.

    ``states`` (W, *S), ``log_decays`` (W, *D) with D broadcastable to S after trailing unsqueezes."""
    if rank == 0:
        return torch.zeros_like(states[0])
    # S_in = sum_{j<r} exp(ld_{j+1} + ... + ld_{r-1}) S_j: every weight at once
    w = prefix_weights(log_decays, rank)
    while w.dim() < states.dim():
        w = w.unsqueeze(-1)
    return (w * states[:rank]).sum(0)


# ---- causal conv: halo exchange ----------------------------------------------------------------

def _tail(x: Tensor, width: int) -> Tensor:
    """The last ``width`` steps of ``x`` (b, d, l), left-padded with zeros when l < width."""
    if x.shape[-1] >= width:
        return x[..., x.shape[-1] - width:]
    return torch.cat([x.new_zeros(*x.shape[:-1], width - x.shape[-1]), x], dim=-1)


def conv_halo(x: Tensor, width: int, full_len: int, rank: int, world: int, group: str) -> Tensor:
    """The ``width`` inputs before this rank's piece (zeros before the sequence start)."""
    tails = exchange(_tail(x, width), rank, world, group)                     # (W, b, d, width)
    sizes = split_sizes(full_len, world)
    pieces = [x.new_zeros(*x.shape[:-1], width)]
    pieces += [tails[j][..., width - min(sizes[j], width):] for j in range(rank)]
    return anchored(_tail(torch.cat(pieces, dim=-1), width), tails)


def cp_causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str, full_len: int,
                     rank: int, world: int, group: str) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv of this rank's piece ``x`` (b, d, l_r) of a length-``full_len`` sequence."""
    halo = conv_halo(x, weight.shape[1] - 1, full_len, rank, world, group)
    return torch.ops.mambac.causal_conv1d(x, weight, bias, halo.contiguous(), activation)


# ---- SSD (Mamba-2): state passing with an output correction -------------------------------------

def ssd_summaries(dt: Tensor, A: Tensor, dt_bias: Optional[Tensor], dt_softplus: bool, dt_min: float,
                  dt_max: float, ct: torch.dtype) -> Tensor:
    """Inclusive cumulative log-decay of every step of this piece, (b, l_r, h) in ``ct``; its last
    step is the piece's total log-decay, the summary that travels with the final state."""
    from mambac.ops.ssd import process_dt
    return torch.cumsum(process_dt(dt, dt_bias, dt_softplus, dt_min, dt_max, ct) * A.to(ct), dim=1)


def ssd_correction(y0: Tensor, C: Tensor, cum: Tensor, s_in: Tensor, z: Optional[Tensor]) -> Tensor:
    """The output of a piece that starts from ``s_in`` instead of zero: y0 + exp(cum_t) C_t S_in,
    then the z gate.  ``y0`` (b, l, h, p) is the zero-start output with the D skip, ungated."""
    b, l, h, p = y0.shape
    g = C.shape[2]
    ct = s_in.dtype
    s = s_in.reshape(b, g, h // g, p, s_in.shape[-1])
    mm_dtype = ct if y0.dtype in (torch.float32, torch.float64) else y0.dtype   # half inputs: half matmul
    corr = torch.einsum("blgn,bgkpn->blgkp", C.to(mm_dtype), s.to(mm_dtype)).reshape(b, l, h, p)
    y = y0.to(ct) + corr.to(ct) * torch.exp(cum).unsqueeze(-1)
    if z is not None:
        y = y * torch.nn.functional.silu(z.to(ct))
    return y.to(y0.dtype)


def cp_ssd(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor], z: Optional[Tensor],
           dt_bias: Optional[Tensor], chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float,
           rank: int, world: int, group: str, final: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """SSD of this rank's piece (x (b, l_r, h, p)); the incoming state comes from the earlier ranks.

    Where generated kernels may run, the piece is the plain SSD from its incoming state with the
    exchange inside it (``cp_ssd_fused``: one extra state pass forward, one backward).  Otherwise
    (PyTorch / float64) ``cp_ssd_corrected``.  ``final`` False (``split_sequence`` passes it when
    nothing reads the op's final state): the final state is not formed and comes back as None."""
    if mambac.ops.kernels_enabled(x.device):
        from mambac.runtime import cp_ssd_fused as fused
        if fused.supported(x, dt, A, B, C, D, z, dt_bias):
            return fused.cp_ssd_fused(x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_min, dt_max,
                                      summary_exchange(rank, world, group), final)
        if fused.fake_form(x, dt, A, B, C, D, z, dt_bias):  # shapes and saved tensors of the form above
            return fused.FakeCPSSD.apply(x, dt, A, B, C, D, z, dt_bias, int(chunk_size), world, bool(final))
    y, last = cp_ssd_corrected(x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_min, dt_max,
                               rank, world, group)
    return y, last if final else None


def summary_exchange(rank: int, world: int, group: str):
    """The all-gather of per-rank (b, k) fp32 rows over ``group``, as the ``Exchange`` that
    ``cp_ssd_fused`` calls in the middle of its forward (summaries) and backward (incoming-state
    gradients)."""
    from mambac.runtime.collectives import _gather
    from mambac.runtime.cp_ssd_fused import Exchange
    return Exchange(gather=lambda t: _gather(t.unsqueeze(0).contiguous(), 0, world, rank, world, group),
                    rank=rank)


def cp_ssd_corrected(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                     z: Optional[Tensor], dt_bias: Optional[Tensor], chunk_size: int, dt_softplus: bool,
                     dt_min: float, dt_max: float, rank: int, world: int, group: str) -> tuple[Tensor, Tensor]:
    """``cp_ssd`` as a zero-start scan plus an output correction (any dtype, autograd through ops).

    One zero-start scan gives the output y0 (D skip included, ungated) and the final state; the
    incoming state S_in then enters linearly: y = y0 + exp(cum_t) C_t S_in (gated by z after), and
    final = final0 + exp(total) S_in.  No second scan."""
    ct = _state_dtype(x)
    y0, local = torch.ops.mambac.ssd(x, dt, A, B, C, D, None, dt_bias, None, chunk_size, dt_softplus,
                                     dt_min, dt_max)
    cum = ssd_summaries(dt, A, dt_bias, dt_softplus, dt_min, dt_max, ct)
    log_decay = cum[:, -1]                                                                  # (b, h)
    gathered = exchange(pack_summaries(local.to(ct), log_decay), rank, world, group)
    states, decays = unpack_summaries(gathered, (local, log_decay))
    s_in = anchored(incoming_state(states, decays, rank), gathered)
    y = ssd_correction(y0, C, cum, s_in, z)
    final = local.to(ct) + torch.exp(log_decay)[..., None, None] * s_in
    return y, final.to(local.dtype)


# ---- selective scan (Mamba-1): state passing ----------------------------------------------------

def cp_selective_scan(u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                      z: Optional[Tensor], delta_bias: Optional[Tensor], delta_softplus: bool,
                      rank: int, world: int, group: str) -> tuple[Tensor, Tensor]:
    """Selective scan of this rank's piece (u (b, d, l_r)); incoming state from the earlier ranks."""
    ct = _state_dtype(u)
    _, local = torch.ops.mambac.selective_scan(u, delta, A, B, C, None, None, delta_bias, None, delta_softplus)
    dl = delta.to(ct)
    if delta_bias is not None:
        dl = dl + delta_bias.to(ct).unsqueeze(-1)
    if delta_softplus:
        dl = torch.nn.functional.softplus(dl)
    log_decay = dl.sum(-1).unsqueeze(-1) * A.to(ct)                                       # (b, d, n)
    gathered = exchange(pack_summaries(local.to(ct), log_decay), rank, world, group)
    states, decays = unpack_summaries(gathered, (local, log_decay))
    s_in = anchored(incoming_state(states, decays, rank), gathered)
    return torch.ops.mambac.selective_scan(u, delta, A, B, C, D, z, delta_bias, s_in, delta_softplus)


# ---- Mamba-3: angle, ssm, last key and last value -------------------------------------------------

def pack_summaries(*parts: Tensor) -> Tensor:
    """One (b, total) tensor from per-batch summaries, so one collective carries them all."""
    return torch.cat([p.reshape(p.shape[0], -1) for p in parts], dim=1)


def unpack_summaries(packed: Tensor, likes: tuple[Tensor, ...]) -> list[Tensor]:
    """Inverse of ``pack_summaries`` for a gathered (W, b, total) tensor: (W, *like.shape) per part."""
    sizes = [t[0].numel() for t in likes]
    return [piece.reshape(packed.shape[0], *t.shape) for piece, t in zip(packed.split(sizes, dim=-1), likes)]


def _wrap(angle: Tensor) -> Tensor:
    two_pi = 2.0 * torch.pi
    return angle - two_pi * torch.floor(angle / two_pi)


def _mamba3_incoming(gathered: list[Tensor], rank: int, rotate, mimo_x: Optional[Tensor]) -> tuple:
    """Rank ``rank``'s incoming (angle, ssm, k, v) from every rank's zero-start summaries.

    A piece started from (phi, h0, k0, v0) ends in angle phi + theta, keys rotated by phi, and
    ssm exp(ld) * (h0 + c * sum_r outer(v0_r, k0_r)) + S0 rotated by phi along n, where c =
    (1 - lam_0) dt_0 is the weight the piece's first step gives the pair preceding it."""
    thetas, ssms, keys, values, lds, cs = gathered
    phi, acc = torch.zeros_like(thetas[0]), torch.zeros_like(ssms[0])
    k_prev, v_prev = torch.zeros_like(keys[0]), torch.zeros_like(values[0])
    for j in range(rank):
        cos, sin = phi.cos(), phi.sin()
        if mimo_x is None:
            pair = torch.einsum("bhp,bhn->bhpn", v_prev, k_prev)
        else:
            pair = torch.einsum("bhp,hrp,brhn->bhpn", v_prev, mimo_x.to(v_prev.dtype), k_prev)
        boundary = acc + cs[j][..., None, None] * pair
        acc = torch.exp(lds[j])[..., None, None] * boundary + rotate(ssms[j], cos.unsqueeze(2), sin.unsqueeze(2))
        k_cos, k_sin = (cos, sin) if mimo_x is None else (cos.unsqueeze(1), sin.unsqueeze(1))
        k_prev, v_prev = rotate(keys[j], k_cos, k_sin), values[j]
        phi = _wrap(phi + thetas[j])
    return phi, acc, k_prev, v_prev


def _mamba3_summaries(first: tuple, dt: Tensor, adt: Tensor, trap: Tensor) -> tuple[Tensor, ...]:
    """(theta, S0, k, v, total log-decay, first-step boundary weight) of a zero-start pass."""
    _, theta, ssm, k, v = first
    ct = ssm.dtype
    c = (1 - torch.sigmoid(trap[:, 0].to(ct))) * dt[:, 0].to(ct)
    return theta, ssm, k, v, adt.to(ct).sum(1), c


def cp_mamba3_siso(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
                   B_bias: Optional[Tensor], C_bias: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor],
                   chunk_size: int, rank: int, world: int, group: str) -> tuple[Tensor, ...]:
    """Mamba-3 SISO scan of this rank's piece (x (b, l_r, h, p)), all four carried parts passed."""
    from mambac.ops.mamba3_siso import rotate_adjacent
    first = torch.ops.mambac.mamba3_siso(x, B, C, dt, adt, trap, angles, B_bias, C_bias, None, None,
                                         None, None, None, None, chunk_size)
    parts = _mamba3_summaries(first, dt, adt, trap)
    packed = exchange(pack_summaries(*parts), rank, world, group)
    phi, ssm, k, v = _mamba3_incoming(unpack_summaries(packed, parts), rank, rotate_adjacent, None)
    ssm = anchored(ssm, packed)
    return torch.ops.mambac.mamba3_siso(x, B, C, dt, adt, trap, angles, B_bias, C_bias, D, z, phi, ssm, k, v,
                                        chunk_size)


def cp_mamba3_mimo(x: Tensor, B: Tensor, C: Tensor, dt: Tensor, adt: Tensor, trap: Tensor, angles: Tensor,
                   B_bias: Optional[Tensor], C_bias: Optional[Tensor], mimo_x: Tensor, mimo_z: Optional[Tensor],
                   mimo_o: Optional[Tensor], D: Optional[Tensor], z: Optional[Tensor], chunk_size: int,
                   rank: int, world: int, group: str) -> tuple[Tensor, ...]:
    """Mamba-3 MIMO scan of this rank's piece, all four carried parts passed."""
    from mambac.ops.mamba3_siso import rotate_halves
    first = torch.ops.mambac.mamba3_mimo(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, None, None,
                                         None, None, None, None, None, None, chunk_size)
    parts = _mamba3_summaries(first, dt, adt, trap)
    packed = exchange(pack_summaries(*parts), rank, world, group)
    phi, ssm, k, v = _mamba3_incoming(unpack_summaries(packed, parts), rank, rotate_halves, mimo_x)
    ssm = anchored(ssm, packed)
    return torch.ops.mambac.mamba3_mimo(x, B, C, dt, adt, trap, angles, B_bias, C_bias, mimo_x, mimo_z, mimo_o,
                                        D, z, phi, ssm, k, v, chunk_size)


# ---- payload (for ``mambac explain``) ---------------------------------------------------------------

CP_FORMS = (cp_causal_conv1d, cp_ssd, cp_selective_scan, cp_mamba3_siso, cp_mamba3_mimo)


def exchange_bytes(form, inputs: tuple, outputs: tuple, world: int) -> int:
    """Bytes one call of a context-parallel form gathers (forward; its backward moves as many
    again: a reduce-scatter, or for SSD on generated kernels an all-gather of the states'
    gradients): every rank's carried state (the form's outputs after the first), plus the total decays
    of the scans (and Mamba-3's boundary weights), fp32 except the conv halo (the input's dtype)."""
    if form is cp_ssd:                                        # its final state may be dropped (None)
        b, _, h, p = inputs[0].shape
        return world * (b * h * p * inputs[3].shape[-1] + b * h) * 4
    carried = sum(t.numel() for t in outputs[1:])
    if form is cp_causal_conv1d:
        return world * carried * inputs[0].element_size()
    if form is cp_selective_scan:
        return world * 2 * carried * 4                       # state and log-decay, both (b, d, n)
    b, h = outputs[1].shape[0], outputs[1].shape[1]
    return world * (carried + 2 * b * h) * 4                  # log-decay and boundary weight
