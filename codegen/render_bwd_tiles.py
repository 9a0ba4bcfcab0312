"""Renderers of the SSD backward's tiled kernels (the matmul-heavy part).

Per head, inside one chunk, with L_ts = exp(cs_t - cs_s) for s <= t, dS the gradient of the
state leaving the chunk and S_in the state entering it:

* ``ssd_dx``  per (source tile s, chunk, batch*head block):
      acc_s = exp(cs_end - cs_s) B_s dS^T + sum_{t>=s} (B_s.C_t) L_ts dy_t
      dx_s = dt'_s acc_s + D dy_s,   ddt_direct_s = x_s.acc_s,
      dcs_s = dy_s.(y_s - D x_s) - dt'_s ddt_direct_s   (both sides of every decay factor)
  ``heads`` heads of one group per program (unrolled) share each B C^T tile.
* ``ssd_dc``  per (target tile t, chunk, batch*group*split): sum over the split's heads of
      exp(cs_t) dy_t S_in + sum_{s<=t} (dy_t.x_s) L_ts dt'_s B_s
* ``ssd_db``  per (source tile s, ...): sum over heads of
      dt'_s exp(cs_end - cs_s) x_s dS + sum_{t>=s} (x_s.dy_t) L_ts dt'_s C_t
  B and C are shared by a group's heads, so the (dy.x) weights are summed over heads first and
  multiplied by B (or C) once per tile pair.
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import (NEG, dense_store, dense_tile, emit_dims, emit_positions,
                                          header, seq_tile, state_tile)
from mambac.codegen.writer import Writer


def render_dx(r: SSDRegion, heads: int = 1) -> str:
    """dx, ddt_direct, the cumsum gradient dcs, chunk-state v sums and dD parts."""
    q, kw, io = r.chunk_size, r.dot_kwargs(), r.tl_io
    w = Writer()
    header(w, "ssd_dx", r, f"Backward for x (and dt, D) with {heads} head(s) per program.")
    args = ["x_ptr", "b_ptr", "c_ptr", "dy_ptr", ("stat_ptr" if r.has_z else "y_ptr")]
    args += ["d_ptr", "dd_ptr"] if r.d_mode != "none" else []
    args += ["dx_ptr", "dtp_ptr", "cs_ptr", "dsout_ptr", "ddtd_ptr", "dcs_ptr", "vpart_ptr",
             "L", "H", "HPG", "NC", "P", "N", "sxb", "sxl", "sxh", "sbb", "sbl", "sbg",
             "scb", "scl", "scg", "BM: tl.constexpr", "BK: tl.constexpr", "PP: tl.constexpr",
             "NP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def ssd_dx({', '.join(args)}):"):
        w.lines("pid_m = tl.program_id(0)", "pid_c = tl.program_id(1)", "pid_bh = tl.program_id(2)",
                "nm = tl.num_programs(0)", f"bi = pid_bh // (H // {heads})",
                f"h0 = (pid_bh % (H // {heads})) * {heads}", "g = h0 // HPG", "bi64 = bi.to(tl.int64)")
        emit_positions(w, "s", "pid_m * BM", "BM", q)
        emit_dims(w)
        w.line("b_s = " + seq_tile("b_ptr", "bi64 * sbb + g * sbg", "pos_s", "sbl", "offs_n", "v_s", "m_n"))
        w.comment("path through the state leaving the chunk")
        for j in range(heads):
            h = f"h0 + {j}"
            w.line(f"row_{j} = (bi64 * H + {h}) * (NC * {q}) + pid_c * {q}")
            w.line(f"cs_s_{j} = tl.load(cs_ptr + row_{j} + s, mask=s < {q}, other=0.0)")
            w.line(f"dt_s_{j} = tl.load(dtp_ptr + row_{j} + s, mask=s < {q}, other=0.0)")
            w.line(f"cend = tl.load(cs_ptr + row_{j} + {q - 1})")
            w.line("ds = " + state_tile("dsout_ptr", f"(bi64 * NC + pid_c) * H + {h}", True))
            w.line(f"acc_{j} = tl.dot(b_s, ds.to({io}){kw}) * tl.exp(cend - cs_s_{j})[:, None]")
            w.line("x_s = " + seq_tile("x_ptr", f"bi64 * sxb + ({h}) * sxh", "pos_s", "sxl", "offs_p",
                                       "v_s", "m_p") + ".to(tl.float32)")
            w.line(f"tl.store(vpart_ptr + ((bi64 * H + {h}) * NC + pid_c) * nm + pid_m, "
                   f"tl.sum(tl.sum(acc_{j} * x_s, 1) * dt_s_{j}, 0))")
        w.comment("intra-chunk path: targets t >= s")
        with w.block(f"for k0 in range((pid_m * BM) // BK * BK, {q}, BK):"):
            emit_positions(w, "t", "k0", "BK", q)
            w.line("c_t = " + seq_tile("c_ptr", "bi64 * scb + g * scg", "pos_t", "scl", "offs_n",
                                       "v_t", "m_n"))
            w.line(f"cbt = tl.dot(b_s, tl.trans(c_t){kw})")
            w.line("causal = (t[None, :] >= s[:, None]) & v_t[None, :]")
            for j in range(heads):
                w.line(f"cs_t = tl.load(cs_ptr + row_{j} + t, mask=t < {q}, other=0.0)")
                w.line(f"wj = cbt * tl.exp(tl.where(causal, cs_t[None, :] - cs_s_{j}[:, None], {NEG}))")
                w.line("dy_t = " + dense_tile("dy_ptr", "pos_t", f"h0 + {j}", "v_t"))
                w.line(f"acc_{j} = tl.dot(wj.to({io}), dy_t, acc_{j}{kw})")
        for j in range(heads):
            _dx_epilogue(w, r, j)
    return w.source()


def _dx_epilogue(w: Writer, r: SSDRegion, j: int) -> None:
    q, h = r.chunk_size, f"h0 + {j}"
    w.comment(f"epilogue of head {j}")
    w.line("x_s = " + seq_tile("x_ptr", f"bi64 * sxb + ({h}) * sxh", "pos_s", "sxl", "offs_p",
                               "v_s", "m_p") + ".to(tl.float32)")
    w.line(f"ddtd = tl.sum(acc_{j} * x_s, 1)")
    w.line(f"dx = acc_{j} * dt_s_{j}[:, None]")
    w.line("dy_s = " + dense_tile("dy_ptr", "pos_s", h, "v_s") + ".to(tl.float32)")
    part = f"((bi64 * NC + pid_c) * nm + pid_m) * H + {h}"
    if r.d_mode == "head":
        w.line(f"dval = tl.load(d_ptr + {h}).to(tl.float32)")
        w.line("dx += dval * dy_s")
        w.line(f"tl.store(dd_ptr + {part}, tl.sum(tl.sum(dy_s * x_s, 1), 0))")
    elif r.d_mode == "head_dim":
        w.line(f"dval = tl.load(d_ptr + ({h}) * P + offs_p, mask=m_p, other=0.0).to(tl.float32)[None, :]")
        w.line("dx += dval * dy_s")
        w.line(f"tl.store(dd_ptr + ({part}) * P + offs_p, tl.sum(dy_s * x_s, 0), mask=m_p)")
    if r.has_z:
        w.line(f"stat = tl.load(stat_ptr + row_{j} + s, mask=s < {q}, other=0.0)")
    else:
        w.line("y_s = " + dense_tile("y_ptr", "pos_s", h, "v_s") + ".to(tl.float32)")
        if r.d_mode != "none":
            w.line("y_s = y_s - dval * x_s")
        w.line("stat = tl.sum(dy_s * y_s, 1)")
    w.line(f"tl.store(ddtd_ptr + row_{j} + s, ddtd, mask=s < {q})")
    w.line(f"tl.store(dcs_ptr + row_{j} + s, stat - dt_s_{j} * ddtd, mask=s < {q})")
    w.line(dense_store("dx_ptr", "pos_s", h, "v_s", "dx.to(dx_ptr.dtype.element_ty)"))


def render_dbc(r: SSDRegion, which: str) -> str:
    """``ssd_dc`` (which="c", target rows) or ``ssd_db`` (which="b", source rows)."""
    if which not in ("b", "c"):
        raise ValueError("which must be 'b' or 'c'")
    q, kw, io = r.chunk_size, r.dot_kwargs(), r.tl_io
    name = f"ssd_d{which}"
    w = Writer()
    header(w, name, r, f"Backward for {which.upper()}: per group, summed over the heads of a split.")
    other = "b" if which == "c" else "c"
    args = ["x_ptr", f"{other}_ptr", "dy_ptr", "dtp_ptr", "cs_ptr",
            "sin_ptr" if which == "c" else "dsout_ptr", "out_ptr", "L", "H", "HPG", "G", "NC",
            "P", "N", "HS", "sxb", "sxl", "sxh", f"s{other}b", f"s{other}l", f"s{other}g",
            "BT: tl.constexpr", "PP: tl.constexpr", "NP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        w.lines("pid_m = tl.program_id(0)", "pid_c = tl.program_id(1)", "pid_x = tl.program_id(2)",
                "bi = pid_x // (G * HS)", "g = (pid_x % (G * HS)) // HS", "hs = pid_x % HS",
                "bi64 = bi.to(tl.int64)", "hps = HPG // HS", "hbase = g * HPG + hs * hps")
        rows = "t" if which == "c" else "s"
        emit_positions(w, rows, "pid_m * BT", "BT", q)
        emit_dims(w)
        w.line("acc = tl.zeros((BT, NP), dtype=tl.float32)")
        with w.block("for hh in range(hbase, hbase + hps):"):
            w.line(f"row = (bi64 * H + hh) * (NC * {q}) + pid_c * {q}")
            w.line(f"cs_r = tl.load(cs_ptr + row + {rows}, mask={rows} < {q}, other=0.0)")
            if which == "c":
                w.comment("path through the state entering the chunk")
                w.line("dy_t = " + dense_tile("dy_ptr", "pos_t", "hh", "v_t"))
                w.line("st = " + state_tile("sin_ptr", "(bi64 * NC + pid_c) * H + hh", False))
                w.line(f"acc += tl.dot(dy_t, st.to({io}){kw}) * tl.exp(cs_r)[:, None]")
            else:
                w.comment("path through the state leaving the chunk")
                w.line(f"dt_r = tl.load(dtp_ptr + row + s, mask=s < {q}, other=0.0)")
                w.line(f"cend = tl.load(cs_ptr + row + {q - 1})")
                w.line("x_s = " + seq_tile("x_ptr", "bi64 * sxb + hh * sxh", "pos_s", "sxl", "offs_p",
                                           "v_s", "m_p"))
                w.line("ds = " + state_tile("dsout_ptr", "(bi64 * NC + pid_c) * H + hh", False))
                w.line(f"acc += tl.dot(x_s, ds.to({io}){kw}) * (dt_r * tl.exp(cend - cs_r))[:, None]")
        _dbc_pairs(w, r, which, q, kw, io)
        w.line(f"out = out_ptr + ((bi64 * L + pos_{rows}[:, None]) * HS + hs) * G * N + g * N"
               " + offs_n[None, :]")
        w.line(f"tl.store(out, acc, mask=v_{rows}[:, None] & m_n[None, :])")
    return w.source()


def _dbc_pairs(w: Writer, r: SSDRegion, which: str, q: int, kw: str, io: str) -> None:
    """Loop over partner tiles; weights summed over heads, then one matmul with B or C."""
    part = "s" if which == "c" else "t"
    loop = ("for k0 in range(0, pid_m * BT + BT, BT):" if which == "c"
            else f"for k0 in range(pid_m * BT, {q}, BT):")
    w.comment("intra-chunk path: " + ("sources s <= t" if which == "c" else "targets t >= s"))
    with w.block(loop):
        emit_positions(w, part, "k0", "BT", q)
        other = "b" if which == "c" else "c"
        w.line(f"{other}_p = " + seq_tile(f"{other}_ptr", f"bi64 * s{other}b + g * s{other}g",
                                          f"pos_{part}", f"s{other}l", "offs_n", f"v_{part}", "m_n"))
        w.line("causal = (t[:, None] >= s[None, :]) & v_s[None, :]" if which == "c"
               else "causal = (t[None, :] >= s[:, None]) & v_t[None, :]")
        w.line("wsum = tl.zeros((BT, BT), dtype=tl.float32)")
        with w.block("for hh in range(hbase, hbase + hps):"):
            w.line(f"row = (bi64 * H + hh) * (NC * {q}) + pid_c * {q}")
            w.line(f"cs_t = tl.load(cs_ptr + row + t, mask=t < {q}, other=0.0)")
            w.line(f"cs_s = tl.load(cs_ptr + row + s, mask=s < {q}, other=0.0)")
            w.line(f"dt_s = tl.load(dtp_ptr + row + s, mask=s < {q}, other=0.0)")
            w.line("dy_t = " + dense_tile("dy_ptr", "pos_t", "hh", "v_t"))
            w.line("x_s = " + seq_tile("x_ptr", "bi64 * sxb + hh * sxh", "pos_s", "sxl", "offs_p",
                                       "v_s", "m_p"))
            if which == "c":
                w.line(f"gm = tl.dot(dy_t, tl.trans(x_s){kw})")
                w.line(f"wsum += gm * tl.exp(tl.where(causal, cs_t[:, None] - cs_s[None, :], {NEG}))"
                       " * dt_s[None, :]")
            else:
                w.line(f"gm = tl.dot(x_s, tl.trans(dy_t){kw})")
                w.line(f"wsum += gm * tl.exp(tl.where(causal, cs_t[None, :] - cs_s[:, None], {NEG}))"
                       " * dt_s[:, None]")
        w.line(f"acc = tl.dot(wsum.to({io}), {other}_p, acc{kw})")
