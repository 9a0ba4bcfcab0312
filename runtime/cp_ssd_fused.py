"""Context-parallel SSD on the generated kernels: a rank's piece is the plain SSD from its incoming
state, with the exchange of summaries in the middle of the forward and of the backward.

Notation, per (batch, head), for a piece of ``nc`` chunks: ``st_c`` the state chunk c builds from
its own inputs, ``tot_c`` its total log-decay (the last entry of its dA cumsum; padded steps add
nothing, so a short last chunk is handled), ``T = sum_c tot_c``, ``P_c = sum_{c'<c} tot_c'``.

Forward (``chunk_state`` once, ``state_pass`` twice, ``chunk_cb`` and ``chunk_scan`` once):

    F_local = state pass of st from zero          (this rank's summary, with T)
    S_in    = exclusive prefix combine of every rank's (F_local, T)   (after the all-gather)
    sin_c   = state pass from S_in = sin_local_c + exp(P_c) S_in,  F = F_local + exp(T) S_in
    y       = chunk scan with sin_c (D skip, z gate fused)

Backward, given (dy, dF).  Later ranks read this rank's (F_local, T) only through
``F_local + exp(T) S_in``, which is F, the final state of the pass from S_in: the gradient they send
back, dF_ext, is a gradient of F, so the ordinary reverse state pass with dfinal = dF + dF_ext, on
the saved sin (from S_in), gives every chunk's leaving-state and total-decay gradient exactly.
(With the exchange's own algebra: the gradient reaching T is exp(T) <S_in, dF_ext>, which is what
the pass's decay terms already count through S_in; so T needs no gradient of its own.)  The
gradient of S_in that goes back to the earlier ranks comes from y and dF only (the later ranks'
use is accounted for by their own weights on F_local):

1. dst (the gradient y gives each chunk's entering state) as in the plain backward; on ranks
   > 0 a reverse state pass with dfinal = dF gives dS_in (rank 0 has no incoming state: zeros).
2. All-gather every rank's dS_in; dF_ext(k) = sum_{r>k} exp(T_{k+1} + ... + T_{r-1}) dS_in(r)
   (``codegen.cp_combine_kernels``).  The last rank has no later ranks: dF_ext = 0 and step 1's
   pass is the one it needs.  Other ranks run the reverse pass again with dfinal = dF + dF_ext.
3. dx, dC (with the true sin), dB and the dt backward as in the plain SSD.

Extra work over the local scan: one state pass forward and, except on the last rank, one reverse
state pass; the two weighted sums over ranks (one kernel each); the two all-gathers.  The
exchange saves only the ranks' total decays (W, b, h) for the backward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from mambac.codegen.ssd_kernels import (Prepared, SSDSaved, prepare, run_chunk_cb, run_chunk_scan,
                                        run_chunk_state, run_state_pass, scan_cb_dtype, with_cb)
from mambac.codegen.ssd_kernels_bwd import (backward_after_passing, run_dstate, run_gate_backward,
                                            run_state_pass_bwd)
from mambac.runtime.context_parallel import pack_summaries, prefix_weights


@dataclass(frozen=True)
class Exchange:
    """How one rank meets the others: ``gather`` stacks every rank's (b, k) fp32 tensor into
    (world, b, k), in rank order.  Every rank calls it once in the forward (summaries) and once in
    the backward (incoming-state gradients)."""

    gather: Callable[[Tensor], Tensor]
    rank: int


def chunk_totals(pr: Prepared, cs: Tensor) -> Tensor:
    """Total log-decay of every chunk, (b, h, nc) fp32: the last entry of each chunk's cumsum."""
    d = pr.dims
    return cs.view(d.b, d.h, d.nc, d.q)[..., d.q - 1]


def suffix_weights(totals: Tensor, rank: int) -> Tensor:
    """(world - 1 - rank, b, h): the weight exp(T_{rank+1} + ... + T_{r-1}) of rank r's incoming
    state gradient in this rank's final-state gradient, for r > rank."""
    between = totals[rank + 1:-1]
    return torch.exp(torch.cat([torch.zeros_like(totals[:1]), between]).cumsum(0))


def with_initial_state(pr: Prepared, init: Tensor) -> Prepared:
    """The same region started from ``init`` (b, h, p, n)."""
    return dataclasses.replace(pr, region=dataclasses.replace(pr.region, has_initial_state=True),
                               init=init.contiguous())


def forward_passes(pr: Prepared, exchange: Exchange) -> tuple:
    """Forward launches around the gather: (y, final, SSDSaved, every rank's total decay (W, b, h))
    (SSDSaved the tensors the backward reuses, its sin the states entering each chunk from S_in)."""
    from mambac.codegen.cp_combine_kernels import weighted_rows
    d = pr.dims
    states, dtp, cs = run_chunk_state(pr)
    sin, f_local = run_state_pass(pr, states, cs)
    gathered = exchange.gather(pack_summaries(f_local, chunk_totals(pr, cs).sum(-1)))
    totals = gathered[..., -d.h:].contiguous()
    final = f_local
    if exchange.rank > 0:             # rank 0: nothing comes in, the zero-start pass is the answer
        s_in = weighted_rows(gathered[:exchange.rank], prefix_weights(totals, exchange.rank),
                             d.h * d.p * d.n).view_as(f_local)
        sin, final = run_state_pass(with_initial_state(pr, s_in), states, cs)
    cb = run_chunk_cb(pr, dtype=scan_cb_dtype(pr))
    y = run_chunk_scan(pr, dtp, cs, sin, cb)
    return y, final, SSDSaved(dtp=dtp, cs=cs, sin=sin, cb=cb), totals


def backward_passes(pr: Prepared, saved: SSDSaved, totals: Tensor, exchange: Exchange, dy: Tensor,
                    dfinal: Tensor, bc_dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Optional[Tensor], ...]:
    """Backward launches around the gather: (dx, ddt, dA, dB, dC, dD, dz, ddt_bias) as
    ``backward_after_passing`` gives them (dB, dC in ``bc_dtypes``), dz in the io dtype (None
    without z)."""
    from mambac.codegen.cp_combine_kernels import weighted_rows
    d, r, rank = pr.dims, pr.region, exchange.rank
    world = totals.shape[0]
    dz = None
    saved = with_cb(pr, saved)
    if r.has_z:
        dz, dyv = run_gate_backward(pr, saved, dy)
    else:
        dyv = dy.to(r.torch_io)
    dst = run_dstate(pr, dyv, saved.cs)
    first = run_state_pass_bwd(pr, dst, saved, dfinal) if rank > 0 else None
    ds_in = first[1] if first is not None else torch.zeros_like(dfinal)
    every = exchange.gather(ds_in.reshape(d.b, -1))
    if rank == world - 1:             # no later ranks: dF_ext = 0, the first pass is the answer
        dsout, _, dtot = first if first is not None else run_state_pass_bwd(pr, dst, saved, dfinal)
    else:
        df_ext = weighted_rows(every[rank + 1:], suffix_weights(totals, rank), d.h * d.p * d.n)
        dsout, _, dtot = run_state_pass_bwd(pr, dst, saved, (dfinal + df_ext.view_as(dfinal)).contiguous())
    dx, ddt, dA, dB, dC, dD, dbias = backward_after_passing(pr, saved, dyv, dsout, dtot, bc_dtypes)
    return dx, ddt, dA, dB, dC, dD, dz, dbias


class CPSSDFunction(torch.autograd.Function):
    """(x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, exchange) ->
    (y, final): this rank's output and its true final state (fp32)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, exchange):
        pr = prepare(x, dt, A, B, C, D, z, dt_bias, None, chunk_size, dt_softplus, dt_min, dt_max)
        y, final, saved, totals = forward_passes(pr, exchange)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, saved.dtp, saved.cs, saved.sin, totals)
        ctx.opts = (chunk_size, dt_softplus, dt_min, dt_max)
        ctx.exchange = exchange
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, dtp, cs, sin, totals = ctx.saved_tensors
        pr = prepare(x, dt, A, B, C, D, z, dt_bias, None, *ctx.opts)
        dy = torch.zeros_like(x) if dy is None else dy.contiguous()
        d = pr.dims
        dfinal = (torch.zeros(d.b, d.h, d.p, d.n, device=x.device, dtype=torch.float32) if dfinal is None
                  else dfinal.float().contiguous())
        dx, ddt, dA, dB, dC, dD, dz, dbias = backward_passes(
            pr, SSDSaved(dtp=dtp, cs=cs, sin=sin), totals, ctx.exchange, dy, dfinal, (B.dtype, C.dtype))
        return (dx, ddt, dA.to(A.dtype), dB, dC,
                None if D is None else dD.to(D.dtype), None if z is None else dz.to(z.dtype),
                None if dt_bias is None else dbias.to(dt_bias.dtype)) + (None,) * 5


class FakeCPSSD(torch.autograd.Function):
    """``CPSSDFunction`` on fake tensors (shape propagation, the memory model's fake run): its
    outputs' shapes, and for autograd's saved-tensor hooks tensors shaped like the ones the real
    Function keeps (the inputs; dtp and cs, (b, h, nc*q) fp32; the entering states, (b, nc, h, p,
    n) in x's dtype; every rank's total decay, (world, b, h) fp32).  Its backward gives zeros of
    the inputs' shapes."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, chunk_size, world):
        b, l, h, p = x.shape
        n = B.shape[-1]
        steps = -(-l // chunk_size) * chunk_size
        f32 = torch.float32
        dtp, cs = x.new_empty(b, h, steps, dtype=f32), x.new_empty(b, h, steps, dtype=f32)
        sin = x.new_empty(b, steps // chunk_size, h, p, n)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, dtp, cs, sin, x.new_empty(world, b, h, dtype=f32))
        return x.new_empty(b, l, h, p), x.new_empty(b, h, p, n, dtype=f32)

    @staticmethod
    def backward(ctx, dy, dfinal):
        inputs = ctx.saved_tensors[:8]
        return tuple(None if t is None else torch.zeros_like(t) for t in inputs) + (None, None)


def fake_form(x: Tensor, *others: Optional[Tensor]) -> bool:
    """Whether these are fake tensors the generated kernels would take if they were real (so the
    fake run mirrors ``cp_ssd_fused`` rather than the PyTorch form)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from mambac.codegen.ssd_kernels import kernels_support
    return isinstance(x, FakeTensor) and kernels_support(x, *others)


def supported(x: Tensor, *others: Optional[Tensor]) -> bool:
    """Whether this form takes these inputs: real tensors (fake ones take ``FakeCPSSD``, meta
    ones the PyTorch form), non-empty, of a dtype and on a device the generated SSD kernels take."""
    from mambac.codegen.ssd_kernels import kernels_support
    tensors = [x] + [t for t in others if t is not None]
    if any(type(t) not in (Tensor, torch.nn.Parameter) or t.device.type == "meta" for t in tensors):
        return False
    return x.numel() > 0 and kernels_support(x, *others)


def cp_ssd_fused(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
                 z: Optional[Tensor], dt_bias: Optional[Tensor], chunk_size: int, dt_softplus: bool,
                 dt_min: float, dt_max: float, exchange: Exchange) -> tuple[Tensor, Tensor]:
    """SSD of this rank's piece on the generated kernels, its incoming state met through
    ``exchange``: (y, this rank's final state in fp32)."""
    return CPSSDFunction.apply(x, dt, A, B, C, D, z, dt_bias, int(chunk_size), bool(dt_softplus),
                               float(dt_min), float(dt_max), exchange)
