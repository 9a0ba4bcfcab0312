"""Renderers of the SSD backward's sequential and per-position kernels.

* ``ssd_state_pass_bwd`` per (state tile, batch*head), chunks in reverse: the gradient of the
  state leaving each chunk, the initial-state gradient, and each chunk's total-decay gradient
  exp(tot) * <S_in, dS_out> as per-tile partial sums.
* ``ssd_dt_backward`` per (chunk, batch, head block), as (positions x heads) tiles: adds the
  chunk-end terms to the cumsum gradient, reverse-cumsums it into d(dt*A), and runs the dt
  prologue backward (clamp, softplus, bias).

Notation (per head, inside one chunk): cs_t = sum_{j<=t} dt'_j A.  The cumsum gradient is

    dcs_t = es_t + sum_s M_ts - sum_u M_ut - v_t      (es from ``ssd_dc``, v from ``ssd_db``,
                                                     both pair sums from ``ssd_dcb``)

and the chunk's last position also receives sum_s v_s and the passing term from here.
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import dt_args, emit_softplus, header, to_io
from mambac.codegen.writer import Writer


def render_state_pass_bwd(r: SSDRegion) -> str:
    """Reverse state passing: dS_out per chunk (io dtype), d initial state (fp32), d tot parts."""
    q = r.chunk_size
    w = Writer()
    header(w, "ssd_state_pass_bwd", r, "Reverse inter-chunk state passing.")
    args = ["dst_ptr", "sin_ptr", "cs_ptr", "dfinal_ptr", "dsout_ptr", "dinit_ptr", "dtot_ptr",
            "H", "NC", "PN", "DTS", "BLK: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def ssd_state_pass_bwd({', '.join(args)}):"):
        w.lines("pid = tl.program_id(0)", "pid_bh = tl.program_id(1)",
                "bh64 = pid_bh.to(tl.int64)", "bi64 = bh64 // H", "h = pid_bh % H",
                "offs = pid * BLK + tl.arange(0, BLK)", "m = offs < PN",
                "ds = tl.load(dfinal_ptr + bh64 * PN + offs, mask=m, other=0.0).to(tl.float32)")
        with w.block("for cc in range(0, NC):"):
            w.line("c = NC - 1 - cc")
            w.line("idx = ((bi64 * NC + c) * H + h) * PN")
            w.comment("ds is the gradient of the state that leaves chunk c")
            w.line(f"tl.store(dsout_ptr + idx + offs, {to_io(r, 'ds')}, mask=m)")
            w.line(f"dec = tl.exp(tl.load(cs_ptr + (bh64 * NC + c) * {q} + {q - 1}))")
            w.line("s_in = tl.load(sin_ptr + idx + offs, mask=m, other=0.0).to(tl.float32)")
            w.line("tl.store(dtot_ptr + (bh64 * NC + c) * DTS + pid, dec * tl.sum(s_in * ds, 0))")
            w.line("ds = ds * dec + tl.load(dst_ptr + idx + offs, mask=m, other=0.0)")
        w.line("tl.store(dinit_ptr + bh64 * PN + offs, ds, mask=m)")
    return w.source()


def render_dt_backward(r: SSDRegion, heads: int) -> str:
    """Cumsum gradient -> d(dt*A) -> ddt (through clamp, softplus, bias), dA and dbias parts, for
    ``heads`` heads per program as (positions x heads) tiles: dt and ddt, laid out (batch, seq,
    heads), are read and written along their contiguous heads axis (one program per (chunk,
    batch, head block); a block may run past the last head)."""
    q = r.chunk_size
    w = Writer()
    header(w, "ssd_dt_backward", r, f"dt backward for {heads} heads per program: reverse cumsum and "
           "the prologue's backward.")
    if r.dt_softplus and r.dt_clamp:
        emit_softplus(w)
    w.line("@triton.jit")
    with w.block(f"def ssd_dt_backward({', '.join(_dt_backward_args(r))}):"):
        w.lines("pid_c = tl.program_id(0)", f"nhb = (H + {heads - 1}) // {heads}",
                "bi64 = (tl.program_id(1) // nhb).to(tl.int64)", f"h0 = (tl.program_id(1) % nhb) * {heads}",
                f"j = tl.arange(0, {heads})", "hh = h0 + j", "mh = hh < H",
                "t = tl.arange(0, QP)", f"mq = t < {q}", f"pos = pid_c * {q} + t",
                "valid = (mq & (pos < L))[:, None] & mh[None, :]", "m2 = mq[:, None] & mh[None, :]",
                "bh = bi64 * H + hh", "part = bh * NC + pid_c", "own = (t // BT)[:, None]")
        w.comment("64-bit offsets only for the block's first element; 32-bit ones inside it")
        w.lines(f"base = (bi64 * H + h0) * (NC * {q}) + pid_c * {q}",
                f"at = j[None, :] * (NC * {q}) + t[:, None]")
        for name in ("v", "es", "dtp", "ddtd"):
            w.line(f"{name}_ptr = {name}_ptr + base")
        w.lines("mrow_ptr = mrow_ptr + base * NT", "mcol_ptr = mcol_ptr + base * NT",
                "dt_ptr = dt_ptr + bi64 * sdb", "ddt_ptr = ddt_ptr + bi64 * L * H")
        w.comment("pair sums (ssd_dcb, tiles of BT): row sums for partner tiles up to a position's own")
        w.comment("tile, column sums from it on")
        w.line("vv = tl.load(v_ptr + at, mask=m2, other=0.0)")
        w.line("dcs = tl.load(es_ptr + at, mask=m2, other=0.0) - vv")
        with w.block("for k in tl.static_range(KP):"):
            w.line("kk = own * 0 + k")
            w.line("dcs += tl.load(mrow_ptr + at * NT + k, mask=m2 & (kk <= own) & (kk < NT), other=0.0)")
            w.line("dcs -= tl.load(mcol_ptr + at * NT + k, mask=m2 & (kk >= own) & (kk < NT), other=0.0)")
        w.comment("chunk-end terms: the chunk-state path (v) and the state-passing path (tot)")
        w.line("it = tl.arange(0, TP)")
        w.line("extra = tl.sum(vv, 0) + tl.sum(tl.load(dtot_ptr + part[None, :] * NDT + it[:, None], "
               "mask=(it < NDT)[:, None] & mh[None, :], other=0.0), 0)")
        w.line(f"dcs = dcs + tl.where((t == {q - 1})[:, None], extra[None, :], 0.0)")
        w.line("dda = tl.cumsum(dcs, 0, reverse=True)")
        w.lines("a = tl.load(a_ptr + hh, mask=mh, other=0.0).to(tl.float32)",
                "d = tl.load(dtp_ptr + at, mask=m2, other=0.0)",
                "g = tl.load(ddtd_ptr + at, mask=m2, other=0.0) + a[None, :] * dda",
                "tl.store(da_ptr + part, tl.sum(dda * d, 0), mask=mh)")
        _prologue_backward(w, r, "pos[:, None] * sdl + hh[None, :] * sdh",
                           "tl.load(bias_ptr + hh, mask=mh, other=0.0).to(tl.float32)[None, :]")
        w.line("g = tl.where(valid, g, 0.0)")
        w.line("tl.store(ddt_ptr + pos[:, None] * H + hh[None, :], g, mask=valid)")
        if r.has_dt_bias:
            w.line("tl.store(dbias_ptr + part, tl.sum(g, 0), mask=mh)")
    return w.source()


def _dt_backward_args(r: SSDRegion) -> list[str]:
    args = ["dt_ptr", "a_ptr"] + dt_args(r) + ["dtp_ptr", "ddtd_ptr", "es_ptr", "v_ptr", "mrow_ptr",
                                               "mcol_ptr", "dtot_ptr", "ddt_ptr", "da_ptr"]
    args += ["dbias_ptr"] if r.has_dt_bias else []
    return args + ["L", "H", "NC", "sdb", "sdl", "sdh", "NT", "BT", "NDT",
                   "QP: tl.constexpr", "KP: tl.constexpr", "TP: tl.constexpr"]


def _prologue_backward(w: Writer, r: SSDRegion, dt_at: str, bias: str) -> None:
    """Chain rule back through clamp (torch's inclusive rule), softplus, bias: last step first.
    ``dt_at`` offsets dt's elements from dt_ptr (already at the batch); ``bias`` is the text that
    loads the bias shaped to broadcast against them."""
    if not (r.dt_clamp or r.dt_softplus):
        return
    w.line(f"v = tl.load(dt_ptr + {dt_at}, mask=valid, other=0.0).to(tl.float32)")
    if r.has_dt_bias:
        w.line(f"bias = {bias}")
        w.line("v = v + bias")
    if r.dt_clamp:
        w.line("pre = " + ("_softplus(v)" if r.dt_softplus else "v"))
        w.line("g = tl.where((pre >= dt_min) & (pre <= dt_max), g, 0.0)")
    if r.dt_softplus:
        w.line("g = tl.where(v > 20.0, g, g * tl.sigmoid(v))")
