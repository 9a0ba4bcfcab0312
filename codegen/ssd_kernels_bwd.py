"""Generated-kernel backward of ``mambac::ssd``, and a differentiable wrapper using it.

``ssd_backward`` returns the gradients of every input of ``mambac::ssd`` in schema order
(x, dt, A, B, C, D, z, dt_bias, initial_state), None where an input is absent.  Launch order:

    [state walk, or chunk_state + state_pass]   only when the forward's intermediates were not kept
    chunk_cb_both               C B^T and B C^T per chunk and group (autograd does not keep them)
    gate_backward               with z: recomputes y; gives dz and the gated dy
    then two independent chains (on CUDA the pair chain on its own stream unless MAMBAC_SSD_STREAMS=0):
      state chain:
        state_walk_bwd          one reverse walk (render_state_walk): dS per chunk, d initial
                                state, d(total decay); where it cannot run or its programs
                                would not fill the GPU (choose_walk),
        or chunk_dstate         per chunk: sum_t exp(cs_t) dy_t C_t^T
         + state_pass_bwd       reverse passing: dS per chunk, d initial state, d(total decay)
        dx                      dx, the direct part of ddt, dD parts
      pair chain:
        dcb                     pair weights summed over each group's heads, their per-head sums
        dc                      dC per group (state path per head, dcb times B)
    and after both:
    db                          dB per group (state path per head, dcb times C)
    dt_backward                 reverse cumsum, prologue backward: ddt, dA and dt_bias parts
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from mambac.codegen import (render_bwd, render_bwd_pairs, render_bwd_tiles, render_fwd, render_state_walk,
                            tma)
from mambac.codegen.kernel_ir import TileConfig
from mambac.codegen.render_common import even_tiles
from mambac.codegen.streams import Branch
from mambac.codegen.ssd_kernels import (Prepared, SSDSaved, choose_walk, dense_out,
                                        dt_extra_args, forward_prepared, prepare, run_states, scan_args,
                                        strides3, with_cb)
from mambac.codegen.ssd_launch import (Family, cdiv, dc_candidates, dcb_candidates, dstate_candidates,
                                       dt_backward_candidates, dx_candidates, group_candidates,
                                       head_block_candidates, pow2, run_family, state_pass_candidates,
                                       walk_candidates)

DSTATE = Family("ssd_chunk_dstate", lambda r, c: render_fwd.render_chunk_state(r, "dstate", 1, c.tma),
                dstate_candidates)
STATE_PASS_BWD = Family("ssd_state_pass_bwd", lambda r, c: render_bwd.render_state_pass_bwd(r),
                        state_pass_candidates)
STATE_WALK_BWD = Family(render_state_walk.NAME_BWD, lambda r, c: render_state_walk.render_state_walk_bwd(r),
                        walk_candidates)
GATE_BWD = Family("ssd_gate_backward",
                  lambda r, c: render_fwd.render_chunk_scan(r, c.heads, "gate_backward"),
                  head_block_candidates)
DX = Family("ssd_dx", lambda r, c: render_bwd_tiles.render_dx(r, c.heads, c.tma), dx_candidates)
DCB = Family(render_bwd_pairs.NAME, lambda r, c: render_bwd_pairs.render_dcb(r, c.heads, c.tma),
             dcb_candidates)
DX_FOLD = Family("ssd_dx_fold", lambda r, c: render_bwd_tiles.render_dx(r, c.heads, c.tma, fold=True),
                 dx_candidates)
DC = Family("ssd_dc", lambda r, c: render_bwd_tiles.render_dbc(r, "c", c.tma), dc_candidates)
DC_PART = Family("ssd_dc_part", lambda r, c: render_bwd_tiles.render_dbc(r, "c", c.tma, part=True),
                 dc_candidates)
DB = Family("ssd_db", lambda r, c: render_bwd_tiles.render_dbc(r, "b", c.tma), group_candidates)
DB_FOLD = Family("ssd_db_fold", lambda r, c: render_bwd_tiles.render_dbc(r, "b", c.tma, fold=True),
                 group_candidates)
DT_BWD = Family("ssd_dt_backward", lambda r, c: render_bwd.render_dt_backward(r, c.heads),
                dt_backward_candidates)


def run_gate_backward(pr: Prepared, saved: SSDSaved, dy_out: Tensor) -> tuple[Tensor, Tensor]:
    """dz and the gated dy (io dtype)."""
    d, r = pr.dims, pr.region
    dz, dy = dense_out(pr, r.torch_io), dense_out(pr, r.torch_io)
    head = [pr.x, saved.cb, pr.C, pr.z] + ([pr.D] if pr.D is not None else [])

    def launch(kern, cfg: TileConfig) -> None:
        kern.launch((cdiv(d.q, cfg.block_m), d.nc, d.b * d.h // cfg.heads),
                    head + [dy_out, dz, dy, saved.dtp, saved.cs, saved.sin, 0] + scan_args(pr),
                    dict(BM=cfg.block_m, BK=cfg.block_k, PP=d.pp, NP=d.np_,
                         EVEN=even_tiles(d, cfg.block_m, cfg.block_k)), cfg)

    run_family(GATE_BWD, r, d, launch)
    return dz, dy


def run_dstate(pr: Prepared, dy: Tensor, cs: Tensor) -> Tensor:
    d = pr.dims
    dst = torch.empty(d.b, d.nc, d.h, d.p, d.n, device=dy.device, dtype=torch.float32)

    def launch(kern, cfg: TileConfig) -> None:
        args = [dy, pr.C, cs, dst, d.l, d.h, d.hpg, d.nc, d.p, d.n] + strides3(pr.C)
        args += tma.launch_descriptors(cfg, even_tiles(d, cfg.block_m, cfg.block_k), "dstate", [
            (dy, 2, (cfg.block_k, cfg.block_m)), (pr.C, 2, (cfg.block_k, d.n))])
        kern.launch((d.nc, d.b * d.h, cdiv(d.p, cfg.block_m)), args,
                    dict(BT=cfg.block_k, BP=cfg.block_m, NP=d.np_), cfg)

    run_family(DSTATE, pr.region, d, launch)
    return dst


def run_state_pass_bwd(pr: Prepared, dst: Tensor, saved: SSDSaved, dfinal: Tensor, room: int = 0):
    """(dS leaving each chunk in the io dtype, d initial state fp32, d total-decay parts); the
    parts' rows have ``room`` more columns, left for the caller to fill."""
    d = pr.dims
    dsout = torch.empty(dst.shape, device=dst.device, dtype=pr.region.torch_io)
    dinit = torch.empty(d.b, d.h, d.p, d.n, device=dst.device, dtype=torch.float32)

    def launch(kern, cfg: TileConfig) -> Tensor:
        tiles = cdiv(d.p * d.n, cfg.block_m)
        dtot = torch.empty(d.b * d.h, d.nc, tiles + room, device=dst.device, dtype=torch.float32)
        kern.launch((tiles, d.b * d.h), [dst, saved.sin, saved.cs, dfinal, dsout, dinit, dtot,
                                         d.h, d.nc, d.p * d.n, tiles + room],
                    dict(BLK=cfg.block_m), cfg)
        return dtot

    dtot = run_family(STATE_PASS_BWD, pr.region, d, launch)
    return dsout, dinit, dtot


def run_state_walk_bwd(pr: Prepared, dy: Tensor, saved: SSDSaved, dfinal: Tensor, room: int = 0):
    """``run_dstate`` + ``run_state_pass_bwd`` as one reverse walk (``render_state_walk``): the
    same (dS leaving each chunk in the io dtype, d initial state fp32, d total-decay parts, with
    ``room``)."""
    d = pr.dims
    dsout = torch.empty(d.b, d.nc, d.h, d.p, d.n, device=dy.device, dtype=pr.region.torch_io)
    dinit = torch.empty(d.b, d.h, d.p, d.n, device=dy.device, dtype=torch.float32)

    def launch(kern, cfg: TileConfig) -> Tensor:
        tiles = (d.p // cfg.block_m) * (d.n // cfg.block_n)
        dtot = torch.empty(d.b * d.h, d.nc, tiles + room, device=dy.device, dtype=torch.float32)
        descs = tma.launch_descriptors(cfg, even_tiles(d, cfg.block_k), "reverse state walk", [
            (dy, 2, (cfg.block_k, cfg.block_m)), (pr.C, 2, (cfg.block_k, cfg.block_n))])
        kern.launch((tiles, d.b * d.h), [saved.cs, saved.sin, dfinal, dsout, dinit, dtot, d.l, d.h, d.hpg,
                                         d.nc, tiles + room] + descs,
                    dict(BT=cfg.block_k, BP=cfg.block_m, BN=cfg.block_n, P=d.p, N=d.n), cfg)
        return dtot

    dtot = run_family(STATE_WALK_BWD, pr.region, d, launch)
    return dsout, dinit, dtot


def run_states_bwd(pr: Prepared, dy: Tensor, saved: SSDSaved, dfinal: Tensor, room: int = 0):
    """(dS leaving each chunk, d initial state, d total-decay parts) by the reverse walk or by the
    per-chunk reductions and the reverse passing, as ``choose_walk`` says; ``room``: columns left
    after the parts for the caller's own (context parallelism's exchange)."""
    if choose_walk(pr) == "walk":
        return run_state_walk_bwd(pr, dy, saved, dfinal, room)
    return run_state_pass_bwd(pr, run_dstate(pr, dy, saved.cs), saved, dfinal, room)


def run_dx(pr: Prepared, dy: Tensor, saved: SSDSaved, dsout: Tensor, fold: Optional[tuple] = None):
    """(dx, the direct part of ddt, dD parts or None); ``fold`` (context parallelism): (fs, fw),
    whose part of ``dsout`` enters as a second dot (``render_common.fold_dot``)."""
    d, r = pr.dims, pr.region
    dx = dense_out(pr, pr.x.dtype)
    ddtd = torch.empty_like(saved.cs)

    def launch(kern, cfg: TileConfig):
        nm = cdiv(d.q, cfg.block_m)
        dshape = (d.b, d.nc, nm, d.h) + ((d.p,) if r.d_mode == "head_dim" else ())
        dd = torch.empty(dshape, device=dy.device, dtype=torch.float32) if pr.D is not None else None
        args = [pr.x, pr.B, saved.cbt, dy] + ([pr.D, dd] if pr.D is not None else [])
        args += [dx, saved.dtp, saved.cs, dsout] + list(fold or ()) + [ddtd, d.l, d.h, d.hpg, d.nc, d.p, d.n]
        args += strides3(pr.x) + strides3(pr.B)
        even = even_tiles(d, cfg.block_m, cfg.block_k)
        args += tma.launch_descriptors(cfg, even, "dx", [
            (pr.B, 2, (cfg.block_m, d.n)), (dsout, 4, (d.p, d.n)), (saved.cbt, 4, (cfg.block_m, cfg.block_k)),
            (dy, 2, (cfg.block_k, d.p))] + ([(fold[0], 3, (d.p, d.n))] if fold is not None else []))
        kern.launch((nm, d.nc, d.b * d.h // cfg.heads), args,
                    dict(BM=cfg.block_m, BK=cfg.block_k, PP=d.pp, NP=d.np_, EVEN=even), cfg)
        return dd

    dd = run_family(DX if fold is None else DX_FOLD, r, d, launch)
    return dx, ddtd, dd


def run_dcb(pr: Prepared, dy: Tensor, saved: SSDSaved) -> tuple[Tensor, Tensor, Tensor, int]:
    """The pair weights summed over each split of each group's heads (splits, batch, chunk, group,
    q, q) fp32, and the per-head row and column sums of the pair terms: (dcb parts, row sums,
    column sums, tile size)."""
    d = pr.dims

    def launch(kern, cfg: TileConfig):
        nt = cdiv(d.q, cfg.block_m)
        dcb = torch.empty(cfg.splits, d.b, d.nc, d.g, d.q, d.q, device=dy.device, dtype=torch.float32)
        mrow = torch.empty(saved.cs.shape + (nt,), device=dy.device, dtype=torch.float32)
        mcol = torch.empty_like(mrow)
        args = [pr.x, dy, saved.dtp, saved.cs, saved.cb, dcb, mrow, mcol, d.l, d.h, d.hpg, d.g, d.nc, d.p,
                cfg.splits, dcb[0].numel()] + strides3(pr.x)
        even = even_tiles(d, cfg.block_m)
        bt = cfg.block_m
        args += tma.launch_descriptors(cfg, even, "dcb", [
            (pr.x, 2, (bt, d.p)), (dy, 2, (bt, d.p)), (saved.cb, 4, (bt, bt))])
        kern.launch((nt * nt, d.nc, d.b * d.g * cfg.splits), args,
                    dict(BT=cfg.block_m, PP=d.pp, EVEN=even), cfg)
        return dcb, mrow, mcol, cfg.block_m

    return run_family(DCB, pr.region, d, launch)


def stored_dtype(pr: Prepared, dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel stores an output in that its caller returns in ``dtype``: that one (the
    store rounds to nearest, and no conversion launch follows), except under the interpreter,
    whose casts truncate: there fp32, and the caller's ``.to(dtype)`` converts."""
    return torch.float32 if pr.region.dot_precision == "upcast" else dtype


def run_dbc(pr: Prepared, which: str, dy: Tensor, saved: SSDSaved, state: Tensor, dcb: Tensor,
            dtype: torch.dtype = torch.float32, fold: Optional[tuple] = None, part: Optional[tuple] = None):
    """dC (which="c", needs the incoming states) or dB ("b", needs dS leaving) in ``dtype``, and
    the state path's per-head cumsum-gradient piece (es or v).  Unsplit, the kernel stores in
    ``dtype`` itself (no conversion launch); split parts are fp32, summed, then converted.
    ``fold`` (dB only): as for ``run_dx``.  ``part`` (dC only, context parallelism): (dF_ext (b,
    h, p, n) in the io dtype, its weights (b, h, nc) fp32, the decay-gradient rows (b*h, nc,
    parts) fp32, contiguous): the kernel writes the later ranks' part of each chunk's total-decay
    gradient into the rows' last ``headdim`` columns, one part per row of the state
    (``render_bwd_tiles._dc_part``)."""
    d = pr.dims
    if part is not None and (which != "c" or fold is not None):
        raise ValueError("run_dbc: only dC takes a total-decay part, and without a fold")
    if part is not None and (part[2].shape[:2] != (d.b * d.h, d.nc) or part[2].shape[-1] < d.p
                             or not part[2].is_contiguous()):
        raise ValueError(f"run_dbc: the decay-gradient rows {tuple(part[2].shape)} must be contiguous "
                         f"(b*h, nc, parts) with at least headdim ({d.p}) parts")
    extra = list(fold or ()) + ([part[0], part[1], part[2], part[2].shape[-1], part[2].shape[-1] - d.p]
                                if part is not None else [])
    side = torch.empty_like(saved.cs)

    def launch(kern, cfg: TileConfig):
        out = torch.empty(d.b, d.l, cfg.splits, d.g, d.n, device=dy.device,
                          dtype=stored_dtype(pr, dtype) if cfg.splits == 1 else torch.float32)
        args = [pr.x, pr.B, pr.C, dy, saved.dtp, saved.cs, state] + extra + [dcb, out, side, d.l, d.h,
                d.hpg, d.g, d.nc, d.p, d.n, cfg.splits, dcb.shape[0], dcb[0].numel()]
        args += strides3(pr.x) + strides3(pr.B) + strides3(pr.C)
        even = even_tiles(d, cfg.block_m, cfg.block_k)
        bt, bs = cfg.block_m, cfg.block_k
        own, other = (pr.C, pr.B) if which == "c" else (pr.B, pr.C)
        args += tma.launch_descriptors(cfg, even, f"d{which}", [
            (own, 2, (bt, d.n)), (dy if which == "c" else pr.x, 2, (bt, d.p)), (state, 4, (d.p, d.n)),
            (other, 2, (bs, d.n)), (dcb, 5, (bt, bs) if which == "c" else (bs, bt))]
            + ([(fold[0], 3, (d.p, d.n))] if fold is not None else []))
        kern.launch((cdiv(d.q, cfg.block_m), d.nc, d.b * d.g * cfg.splits), args,
                    dict(BT=cfg.block_m, BS=cfg.block_k, PP=d.pp, NP=d.np_, EVEN=even), cfg)
        return out

    fam = (DC if part is None else DC_PART) if which == "c" else DB if fold is None else DB_FOLD
    out = run_family(fam, pr.region, d, launch)
    return (out[:, :, 0] if out.shape[2] == 1 else out.sum(2)).to(dtype), side


def run_dt_backward(pr: Prepared, saved: SSDSaved, ddtd: Tensor, es: Tensor, v: Tensor, pairs: tuple,
                    dtot: Tensor) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(ddt in dt's dtype and layout, dA parts, dt_bias parts or None); ``pairs`` is what
    ``run_dcb`` gives after dCB: (row sums, column sums, tile size)."""
    d, r = pr.dims, pr.region
    mrow, mcol, tile = pairs
    ddt = torch.empty(d.b, d.l, d.h, device=ddtd.device, dtype=stored_dtype(pr, pr.dt.dtype))
    da = torch.empty(d.b * d.h, d.nc, device=ddtd.device, dtype=torch.float32)
    dbias = torch.empty_like(da) if r.has_dt_bias else None
    nt, ndt = mrow.shape[-1], dtot.shape[-1]

    def launch(kern, cfg: TileConfig) -> None:
        args = [pr.dt, pr.A] + dt_extra_args(pr) + [saved.dtp, ddtd, es, v, mrow, mcol, dtot, ddt, da]
        args += ([dbias] if dbias is not None else []) + [d.l, d.h, d.nc] + strides3(pr.dt)
        kern.launch((d.nc, d.b * cdiv(d.h, cfg.heads)), args + [nt, tile, ndt],
                    dict(QP=pow2(d.q), KP=pow2(nt), TP=pow2(ndt)), cfg)

    run_family(DT_BWD, r, d, launch)
    return ddt.to(pr.dt.dtype), da, dbias


def ssd_backward(dy: Tensor, dfinal: Optional[Tensor], x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
                 C: Tensor, D: Optional[Tensor], z: Optional[Tensor], dt_bias: Optional[Tensor],
                 initial_state: Optional[Tensor], chunk_size: int, dt_softplus: bool,
                 dt_min: float = 0.0, dt_max: float = math.inf, *,
                 saved: Optional[SSDSaved] = None) -> tuple[Optional[Tensor], ...]:
    """Gradients of ``mambac::ssd`` w.r.t. (x, dt, A, B, C, D, z, dt_bias, initial_state).

    ``dy``/``dfinal`` are the gradients of y and final_state (dfinal may be None).  ``saved``
    (from ``ssd_forward(..., return_saved=True)``) skips recomputing the chunk states.
    """
    pr = prepare(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus, dt_min, dt_max)
    d, r = pr.dims, pr.region
    if saved is None:
        sin, _, dtp, cs = run_states(pr, choose_walk(pr))
        saved = SSDSaved(dtp=dtp, cs=cs, sin=sin)
    saved = with_cb(pr, saved)
    dy = dy.contiguous()
    dz = None
    if r.has_z:
        dz, dyv = run_gate_backward(pr, saved, dy)
    else:
        dyv = dy.to(r.torch_io)
    if dfinal is None:
        dfinal = torch.zeros(d.b, d.h, d.p, d.n, device=x.device, dtype=torch.float32)
    pairs = start_pair_chain(pr, saved, dyv, C.dtype)   # beside the state chain below
    dsout, dinit, dtot = run_states_bwd(pr, dyv, saved, dfinal.contiguous())
    dx, ddt, dA, dB, dC, dD, dbias = backward_after_passing(pr, saved, dyv, dsout, dtot, (B.dtype, C.dtype),
                                                            pairs)
    return (dx, ddt, dA.to(A.dtype), dB, dC,
            None if D is None else dD.to(D.dtype), None if z is None else dz.to(z.dtype),
            None if dt_bias is None else dbias.to(dt_bias.dtype),
            None if initial_state is None else dinit.to(initial_state.dtype))


@dataclass
class PairChain:
    """The pair chain of the backward, queued on the side stream (``codegen/streams.py``; in place
    unless the two-stream form is on): the pair weights, their row and column sums, dC and the state
    path's es; valid after ``branch.join()``."""

    branch: Branch
    dcb: Tensor
    pairs: tuple
    dC: Tensor
    es: Tensor


def start_pair_chain(pr: Prepared, saved: SSDSaved, dyv: Tensor, c_dtype: torch.dtype,
                     with_dc: bool = True) -> PairChain:
    """Queue dcb and dC (they need neither dS nor dx) on the side stream, if any; ``saved`` must
    hold C B^T.  ``with_dc`` False: dcb only, the caller adds dC later (``add_dc``)."""
    branch = Branch(dyv.device)
    with branch.run():
        dcb, *pairs = run_dcb(pr, dyv, saved)
        dC, es = run_dbc(pr, "c", dyv, saved, saved.sin, dcb, c_dtype) if with_dc else (None, None)
    return PairChain(branch, dcb, tuple(pairs), dC, es)


def add_dc(pr: Prepared, saved: SSDSaved, dyv: Tensor, c_dtype: torch.dtype, chain: PairChain,
           part: tuple) -> PairChain:
    """The pair chain with dC queued after everything queued so far on the current stream (on the
    side stream, beside what follows), taking ``part`` as ``run_dbc`` does."""
    with chain.branch.run():
        dC, es = run_dbc(pr, "c", dyv, saved, saved.sin, chain.dcb, c_dtype, part=part)
    return PairChain(chain.branch, chain.dcb, chain.pairs, dC, es)


def backward_after_passing(pr: Prepared, saved: SSDSaved, dyv: Tensor, dsout: Tensor, dtot: Tensor,
                           bc_dtypes: tuple[torch.dtype, torch.dtype],
                           pairs: Optional[PairChain] = None,
                           fold: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Optional[Tensor], ...]:
    """The launches after the reverse state passing, given the gated dy, the gradient of the state
    leaving each chunk and the chunks' total-decay gradient parts: (dx, ddt, dA, dB, dC, dD,
    ddt_bias), dx in x's dtype, ddt in dt's, dB and dC in ``bc_dtypes`` (B's and C's), the others
    fp32, None where the region has no D / dt_bias.
    A caller that passes states its own way (context parallelism) supplies ``dsout``/``dtot``;
    ``pairs`` is the pair chain when the caller started it earlier (else it starts here, beside dx);
    ``fold``: (fs, fw), a part of ``dsout`` that dx and dB take as a second dot (``run_dx``)."""
    d = pr.dims
    saved = with_cb(pr, saved)
    if pairs is None:
        pairs = start_pair_chain(pr, saved, dyv, bc_dtypes[1])
    dx, ddtd, dd = run_dx(pr, dyv, saved, dsout, fold)
    pairs.branch.join()
    dB, v = run_dbc(pr, "b", dyv, saved, dsout, pairs.dcb, bc_dtypes[0], fold)
    ddt, da, dbias = run_dt_backward(pr, saved, ddtd, pairs.es, v, pairs.pairs, dtot)
    dA = da.view(d.b, d.h, d.nc).sum((0, 2))
    dD = None if pr.D is None else dd.sum((0, 1, 2))
    dbias = None if dbias is None else dbias.view(d.b, d.h, d.nc).sum((0, 2))
    return dx, ddt, dA, dB, pairs.dC, dD, dbias


class _SSDFunction(torch.autograd.Function):
    """Autograd over the generated forward and backward (keeps the forward's intermediates)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus,
                dt_min, dt_max):
        y, final, saved = ssd_forward_saved(x, dt, A, B, C, D, z, dt_bias, initial_state,
                                            chunk_size, dt_softplus, dt_min, dt_max)
        ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_state,
                              saved.dtp, saved.cs, saved.sin)
        ctx.opts = (chunk_size, dt_softplus, dt_min, dt_max)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, dt, A, B, C, D, z, dt_bias, init, dtp, cs, sin = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(x)
        grads = ssd_backward(dy, dfinal, x, dt, A, B, C, D, z, dt_bias, init, *ctx.opts,
                             saved=SSDSaved(dtp=dtp, cs=cs, sin=sin))
        return grads + (None, None, None, None)


def ssd_forward_saved(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus,
                      dt_min, dt_max):
    """Forward that also returns the intermediates ``ssd_backward`` can reuse."""
    pr = prepare(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus, dt_min, dt_max)
    return forward_prepared(pr)


def ssd_triton(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int = 256,
               D: Optional[Tensor] = None, z: Optional[Tensor] = None,
               dt_bias: Optional[Tensor] = None, initial_state: Optional[Tensor] = None,
               dt_softplus: bool = False, dt_min: float = 0.0,
               dt_max: float = math.inf) -> tuple[Tensor, Tensor]:
    """Differentiable SSD on the generated kernels (forward and backward): (y, final_state)."""
    return _SSDFunction.apply(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size,
                              dt_softplus, float(dt_min), float(dt_max))
