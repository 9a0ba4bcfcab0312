"""Context-parallel SSD on the generated kernels: a rank's piece is the plain SSD from its incoming
state, with the exchange of summaries in the middle of the forward and of the backward.

Notation, per (batch, head), for a piece of ``nc`` chunks: ``st_c`` the state chunk c builds from
its own inputs, ``tot_c`` its total log-decay (the last entry of its dA cumsum; padded steps add
nothing, so a short last chunk is handled), ``T = sum_c tot_c``, ``P_c = sum_{c'<c} tot_c'``.

Forward (the plain SSD's launches, plus one small launch on ranks > 0):

    sin0_c, F_local = the states from zero (the walk, or chunk states + state pass, as the plain
                      SSD takes them): this rank's summary is (F_local, T)
    S_in    = exclusive prefix combine of every rank's (F_local, T)   (after the all-gather)
              (``incoming_state``: S_in, the weights exp(P_c) and F = F_local + exp(T) S_in)
    y       = chunk scan with sin_c = sin0_c + exp(P_c) S_in: C sin_c as C sin0_c + exp(P_c) C S_in,
              two dots; its first row tile stores sin_c for the backward (the chunk scan's fold
              form); D skip, z gate fused

Backward, given (dy, dF).  Later ranks read this rank's (F_local, T) only through
``F_local + exp(T) S_in``, which is F, the final state from S_in: the gradient they send back,
dF_ext, is a gradient of F, so the ordinary reverse state pass with dfinal = dF + dF_ext, on the
saved sin (from S_in), gives every chunk's leaving-state and total-decay gradient exactly.  (With
the exchange's own algebra: the gradient reaching T is exp(T) <S_in, dF_ext>, which is what the
pass's decay terms already count through S_in; so T needs no gradient of its own.)  The gradient
of S_in that goes back to the earlier ranks comes from y and dF only (the later ranks' use is
accounted for by their own weights on F_local):

1. The plain backward's reverse walk (or chunk dstate + reverse state pass) with dfinal = dF:
   the gradient of each chunk's leaving state, the chunks' total-decay gradient parts, and dS_in
   (the gradient of the state entering the piece).
2. All-gather every rank's dS_in; dF_ext(k) = sum_{r>k} exp(T_{k+1} + ... + T_{r-1}) dS_in(r).
   The pass is linear in dfinal, so adding dF_ext adds exp(tot_{c+1} + ... + tot_{nc-1}) dF_ext
   to the gradient of chunk c's leaving state and exp(tot_c) <sin_c, that> to its total-decay
   gradient (``outgoing_gradient``: one launch forms dF_ext and the weights; dC, which reads
   every sin_c anyway, forms the decay-gradient parts, so it waits for that launch on ranks that
   have later ranks).  The last rank has no later ranks: dF_ext = 0 and step 1 is the answer.
3. dx, dC (with the true sin), dB and the dt backward as in the plain SSD, dx and dB adding
   the weighted dF_ext's dot to their dot with each leaving-state gradient (their fold forms).

Extra work over the local scan: the two small launches (the forward's reads the earlier ranks'
final states, the backward's the later ranks' state gradients), the folds inside the chunk scan,
dx and dB (one more (headdim x dstate) tile per program, the same for every chunk of a head), the
store of the folded states, dC's decay-gradient parts (one more tile and a sum per (chunk, head))
and the two all-gathers (the states' launches write the final state straight into the summary row
that is sent).  The exchange saves only the ranks' total decays (W, b, h) for the backward.
Without ``want_final`` (nothing reads the final state) the forward's small launch neither reads
this piece's final state from zero nor writes its true one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from mambac.codegen.ssd_kernels import (Prepared, SSDSaved, forward_path, prepare, run_chunk_cb,
                                        run_chunk_scan, run_states, scan_cb_dtype, with_cb)
from mambac.codegen.ssd_kernels_bwd import (add_dc, backward_after_passing, run_gate_backward, run_states_bwd,
                                            start_pair_chain)
from mambac.codegen.streams import Branch


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


def forward_passes(pr: Prepared, exchange: Exchange, want_final: bool = True) -> tuple:
    """Forward launches around the gather: (y, final, SSDSaved, every rank's total decay (W, b, h))
    (SSDSaved the tensors the backward reuses, its sin the states entering each chunk from S_in);
    final is None without ``want_final`` (then it is neither formed nor copied)."""
    from mambac.codegen.cp_combine_kernels import incoming_state
    d = pr.dims
    branch = Branch(pr.x.device)       # C B^T beside the states, as in the plain forward
    with branch.run():
        cb = run_chunk_cb(pr, dtype=scan_cb_dtype(pr))
    hpn = d.h * d.p * d.n              # the summary row: the final state from zero, then the total decay
    summary = torch.empty(d.b, hpn + d.h, device=pr.x.device, dtype=torch.float32)
    path = forward_path(pr)
    # the final state into the summary's rows: their stride tells the walk that a row also holds
    # the total decays (as_strided keeps it where a view of one row would not)
    rows = summary.as_strided((d.b, d.h, d.p, d.n), (hpn + d.h, d.p * d.n, d.n, 1))
    sin0, final, dtp, cs = run_states(pr, path, rows)
    if path != "walk":                 # the walk writes the total decays into the summary itself
        torch.sum(chunk_totals(pr, cs), -1, out=summary[:, hpn:])
    gathered = exchange.gather(summary)
    if exchange.rank > 0:              # the launch also keeps every rank's total decay for the backward
        fs, final, fw, totals = incoming_state(gathered, exchange.rank, cs, final, d.q, pr.region.torch_io,
                                               want_final)
        sin = torch.empty_like(sin0)
        fold = (fs, fw, sin)
    else:                              # rank 0: nothing comes in, the zero-start states are the answer
        sin, fold, final = sin0, None, final.contiguous() if want_final else None
        totals = gathered[..., -d.h:].contiguous()
    branch.join()
    y = run_chunk_scan(pr, dtp, cs, sin0, cb, fold=fold)
    return y, final, SSDSaved(dtp=dtp, cs=cs, sin=sin, cb=cb), totals


def backward_passes(pr: Prepared, saved: SSDSaved, totals: Tensor, exchange: Exchange, dy: Tensor,
                    dfinal: Tensor, bc_dtypes: tuple[torch.dtype, torch.dtype]) -> tuple[Optional[Tensor], ...]:
    """Backward launches around the gather: (dx, ddt, dA, dB, dC, dD, dz, ddt_bias) as
    ``backward_after_passing`` gives them (dB, dC in ``bc_dtypes``), dz in the io dtype (None
    without z)."""
    from mambac.codegen.cp_combine_kernels import outgoing_gradient
    d, r, rank = pr.dims, pr.region, exchange.rank
    world = totals.shape[0]
    dz = None
    saved = with_cb(pr, saved)
    if r.has_z:
        dz, dyv = run_gate_backward(pr, saved, dy)
    else:
        dyv = dy.to(r.torch_io)
    later = rank < world - 1           # the last rank has no later ranks: dF_ext = 0
    # beside the state chain, as in the plain backward; with later ranks dC waits for dF_ext
    pairs = start_pair_chain(pr, saved, dyv, bc_dtypes[1], with_dc=not later)
    dsout, ds_in, dtot = run_states_bwd(pr, dyv, saved, dfinal, d.p if later else 0)
    every = exchange.gather(ds_in.reshape(d.b, -1))          # rank 0's row is never read
    fold = None
    if later:                          # dC writes its decay-gradient parts into the columns left in dtot
        fold = outgoing_gradient(every, totals, rank, saved.cs, (d.b, d.h, d.p, d.n), d.q, r.torch_io)
        pairs = add_dc(pr, saved, dyv, bc_dtypes[1], pairs, (fold[0], fold[1], dtot))
    dx, ddt, dA, dB, dC, dD, dbias = backward_after_passing(pr, saved, dyv, dsout, dtot, bc_dtypes, pairs, fold)
    return dx, ddt, dA, dB, dC, dD, dz, dbias


class CPSSDFunction(torch.autograd.Function):
    """(x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, exchange,
    want_final) -> (y, final): this rank's output and its true final state (fp32; None without
    ``want_final``)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, chunk_size, dt_softplus, dt_min, dt_max, exchange,
                want_final):
        pr = prepare(x, dt, A, B, C, D, z, dt_bias, None, chunk_size, dt_softplus, dt_min, dt_max)
        y, final, saved, totals = forward_passes(pr, exchange, want_final)
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
                None if dt_bias is None else dbias.to(dt_bias.dtype)) + (None,) * 6


class FakeCPSSD(torch.autograd.Function):
    """``CPSSDFunction`` on fake tensors (shape propagation, the memory model's fake run): its
    outputs' shapes, and for autograd's saved-tensor hooks tensors shaped like the ones the real
    Function keeps (the inputs; dtp and cs, (b, h, nc*q) fp32; the entering states, (b, nc, h, p,
    n) in x's dtype; every rank's total decay, (world, b, h) fp32).  Its backward gives zeros of
    the inputs' shapes."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, chunk_size, world, want_final=True):
        b, l, h, p = x.shape
        n = B.shape[-1]
        steps = -(-l // chunk_size) * chunk_size
        f32 = torch.float32
        dtp, cs = x.new_empty(b, h, steps, dtype=f32), x.new_empty(b, h, steps, dtype=f32)
        sin = x.new_empty(b, steps // chunk_size, h, p, n)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, dtp, cs, sin, x.new_empty(world, b, h, dtype=f32))
        return x.new_empty(b, l, h, p), x.new_empty(b, h, p, n, dtype=f32) if want_final else None

    @staticmethod
    def backward(ctx, dy, dfinal):
        inputs = ctx.saved_tensors[:8]
        return tuple(None if t is None else torch.zeros_like(t) for t in inputs) + (None, None, None)


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
                 dt_min: float, dt_max: float, exchange: Exchange,
                 want_final: bool = True) -> tuple[Tensor, Optional[Tensor]]:
    """SSD of this rank's piece on the generated kernels, its incoming state met through
    ``exchange``: (y, this rank's final state in fp32, or None without ``want_final``: a caller
    that never reads it saves the final state's formation, a read and a write of it)."""
    return CPSSDFunction.apply(x, dt, A, B, C, D, z, dt_bias, int(chunk_size), bool(dt_softplus),
                               float(dt_min), float(dt_max), exchange, bool(want_final))
