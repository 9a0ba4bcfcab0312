"""Renderers of the SSD backward's sequential and per-position kernels.

* ``ssd_state_pass_bwd`` per (state tile, batch*head), chunks in reverse: the gradient of the
  state leaving each chunk, the initial-state gradient, and each chunk's total-decay gradient
  exp(tot) * <S_in, dS_out> as per-tile partial sums.
* ``ssd_dt_backward`` per (chunk, batch*head): adds the chunk-end terms to the cumsum gradient,
  reverse-cumsums it into d(dt*A), and runs the dt prologue backward (clamp, softplus, bias).

Notation (per head, inside one chunk): cs_t = sum_{j<=t} dt'_j A.  The cumsum gradient is

    dcs_t = es_t + sum_s M_ts - sum_u M_ut - v_t      (es from ``ssd_dc``, v from ``ssd_db``,
                                                     both pair sums from ``ssd_dcb``)

and the chunk's last position also receives sum_s v_s and the passing term from here.
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import dt_args, emit_softplus, header, load_bias, to_io
from mambac.codegen.writer import Writer


def render_state_pass_bwd(r: SSDRegion) -> str:
    """Reverse state passing: dS_out per chunk (io dtype), d initial state (fp32), d tot parts."""
    q = r.chunk_size
    w = Writer()
    header(w, "ssd_state_pass_bwd", r, "Reverse inter-chunk state passing.")
    args = ["dst_ptr", "sin_ptr", "cs_ptr", "dfinal_ptr", "dsout_ptr", "dinit_ptr", "dtot_ptr",
            "H", "NC", "PN", "BLK: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def ssd_state_pass_bwd({', '.join(args)}):"):
        w.lines("pid = tl.program_id(0)", "pid_bh = tl.program_id(1)", "ntiles = tl.num_programs(0)",
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
            w.line("tl.store(dtot_ptr + (bh64 * NC + c) * ntiles + pid, dec * tl.sum(s_in * ds, 0))")
            w.line("ds = ds * dec + tl.load(dst_ptr + idx + offs, mask=m, other=0.0)")
        w.line("tl.store(dinit_ptr + bh64 * PN + offs, ds, mask=m)")
    return w.source()


def render_dt_backward(r: SSDRegion) -> str:
    """Cumsum gradient -> d(dt*A) -> ddt (through clamp, softplus, bias); dA and dbias parts."""
    q = r.chunk_size
    w = Writer()
    header(w, "ssd_dt_backward", r, "dt backward: reverse cumsum and the prologue's backward.")
    if r.dt_softplus and r.dt_clamp:
        emit_softplus(w)
    args = ["dt_ptr", "a_ptr"] + dt_args(r) + ["dtp_ptr", "ddtd_ptr", "es_ptr", "v_ptr", "mrow_ptr",
                                               "mcol_ptr", "dtot_ptr", "ddt_ptr", "da_ptr"]
    args += ["dbias_ptr"] if r.has_dt_bias else []
    args += ["L", "H", "NC", "sdb", "sdl", "sdh", "NT", "BT", "NDT",
             "QP: tl.constexpr", "KP: tl.constexpr", "TP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def ssd_dt_backward({', '.join(args)}):"):
        w.lines("pid_c = tl.program_id(0)", "pid_bh = tl.program_id(1)", "bh64 = pid_bh.to(tl.int64)",
                "bi64 = bh64 // H", "h = pid_bh % H", "t = tl.arange(0, QP)", f"mq = t < {q}",
                f"pos = pid_c * {q} + t", "valid = mq & (pos < L)",
                f"row = bh64 * (NC * {q}) + pid_c * {q}", "part = bh64 * NC + pid_c",
                "k = tl.arange(0, KP)", "it = tl.arange(0, TP)", "own = (t // BT)[:, None]")
        w.comment("pair sums (ssd_dcb, tiles of BT): slot k of a position holds partner tile k; row sums")
        w.comment("exist for partner tiles up to the position's own tile, column sums from it on")
        w.line("mr = tl.load(mrow_ptr + (row + t)[:, None] * NT + k[None, :], "
               "mask=mq[:, None] & (k[None, :] <= own) & (k[None, :] < NT), other=0.0)")
        w.line("mc = tl.load(mcol_ptr + (row + t)[:, None] * NT + k[None, :], "
               "mask=mq[:, None] & (k[None, :] >= own) & (k[None, :] < NT), other=0.0)")
        w.line("v = tl.load(v_ptr + row + t, mask=mq, other=0.0)")
        w.line("dcs = tl.load(es_ptr + row + t, mask=mq, other=0.0) + tl.sum(mr, 1) - tl.sum(mc, 1) - v")
        w.comment("chunk-end terms: the chunk-state path (v) and the state-passing path (tot)")
        w.line("extra = tl.sum(v, 0) + tl.sum(tl.load(dtot_ptr + part * NDT + it, mask=it < NDT, "
               "other=0.0), 0)")
        w.line(f"dcs = dcs + tl.where(t == {q - 1}, extra, 0.0)")
        w.line("dda = tl.cumsum(dcs, 0, reverse=True)")
        w.lines("a = tl.load(a_ptr + h).to(tl.float32)",
                "d = tl.load(dtp_ptr + row + t, mask=mq, other=0.0)",
                "g = tl.load(ddtd_ptr + row + t, mask=mq, other=0.0) + a * dda",
                "tl.store(da_ptr + part, tl.sum(dda * d, 0))")
        _prologue_backward(w, r)
        w.line("g = tl.where(valid, g, 0.0)")
        w.line("tl.store(ddt_ptr + (bi64 * L + pos) * H + h, g, mask=valid)")
        if r.has_dt_bias:
            w.line("tl.store(dbias_ptr + part, tl.sum(g, 0))")
    return w.source()


def _prologue_backward(w: Writer, r: SSDRegion) -> None:
    """Chain rule back through clamp (torch's inclusive rule), softplus, bias: last step first."""
    if not (r.dt_clamp or r.dt_softplus):
        return
    w.line("v = tl.load(dt_ptr + bi64 * sdb + pos * sdl + h * sdh, mask=valid, other=0.0)"
           ".to(tl.float32)")
    load_bias(w, r, "h")
    if r.has_dt_bias:
        w.line("v = v + bias")
    if r.dt_clamp:
        w.line("pre = " + ("_softplus(v)" if r.dt_softplus else "v"))
        w.line("g = tl.where((pre >= dt_min) & (pre <= dt_max), g, 0.0)")
    if r.dt_softplus:
        w.line("g = tl.where(v > 20.0, g, g * tl.sigmoid(v))")
