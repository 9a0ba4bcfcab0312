"""Renderers of the SSD backward's tiled kernels (the matmul-heavy part).

Per head, inside one chunk, with L_ts = exp(cs_t - cs_s) for s <= t, dS the gradient of the
state leaving the chunk, S_in the state entering it, G_ts = dy_t.x_s and the pair weight
W_ts = G_ts L_ts dt'_s:

* ``ssd_dx``  per (source tile s, chunk, batch*head block):
      acc_s = exp(cs_end - cs_s) B_s dS^T + sum_{t>=s} (B_s.C_t) L_ts dy_t
      dx_s = dt'_s acc_s + D dy_s,   ddt_direct_s = x_s.acc_s
  ``heads`` heads of one group per program (unrolled); B_s.C_t comes from ``ssd_chunk_cb_both``'s
  transposed product.
* ``ssd_dc``  per (target tile t, chunk, batch*group*split): sum over the split's heads of
      exp(cs_t) dy_t S_in,  plus  sum_{s<=t} dCB_ts B_s  (first split only)
* ``ssd_db``  per (source tile s, ...): sum over heads of
      dt'_s exp(cs_end - cs_s) x_s dS,  plus  sum_{t>=s} dCB_ts C_t
  where dCB = sum over the group's heads of W (``render_bwd_pairs.ssd_dcb``): B and C are shared
  by a group's heads, so W is summed before the matmul.

Rows come in tiles of BT, partners in tiles of BS.  The kernels also write the state paths'
pieces of the cumsum gradient, per head: exp(cs_t) dy_t.(S_in C_t) (dc) and the chunk-state
term v_s (db); the pair terms' pieces come from ``ssd_dcb``.
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_fwd import cb_tile
from mambac.codegen.render_common import (FOLD_ARGS, NEG, dense_store, dense_tile, dot, emit_descriptor_rows,
                                          emit_dims, emit_positions, fold_dot, header, seq_tile, state_tile,
                                          to_io)
from mambac.codegen.writer import Writer


def render_dx(r: SSDRegion, heads: int = 1, tma: bool = False, fold: bool = False) -> str:
    """dx, the direct dt gradient x.acc and the dD parts, ``heads`` heads per program; B_s.C_t
    comes from ``cb_ptr``, the transposed product of ``ssd_chunk_cb_both``, read along its rows
    (reading C B^T across, as it did before, took 305 us at S1 instead of 293).

    ``tma``: B, dS, B C^T and the targets' dy come through tensor descriptors (``bd`` over B as
    (batch*seqlen, groups*dstate), ``dsd`` over dS as (batch*chunks*heads*headdim, dstate),
    ``cbd`` over B C^T as (batch*chunks*groups*chunk, chunk), ``dyd`` over dy as
    (batch*seqlen, heads*headdim)); only for EVEN launches.  ``fold`` (context parallelism,
    ``ssd_dx_fold``): the later ranks' part of dS enters as a second dot (``render_common.fold_dot``)."""
    q, io = r.chunk_size, r.tl_io
    name = "ssd_dx" + ("_fold" if fold else "")
    w = Writer()
    header(w, name, r, f"Backward for x (and dt, D) with {heads} head(s) per program.")
    args = ["x_ptr", "b_ptr", "cb_ptr", "dy_ptr"] + (["d_ptr", "dd_ptr"] if r.d_mode != "none" else [])
    args += ["dx_ptr", "dtp_ptr", "cs_ptr", "dsout_ptr"] + (FOLD_ARGS if fold else [])
    args += ["ddtd_ptr", "L", "H", "HPG", "NC", "P", "N", "sxb", "sxl", "sxh", "sbb", "sbl", "sbg"]
    args += ["bd", "dsd", "cbd", "dyd"] + (["fsd"] if fold else []) if tma else []
    args += ["BM: tl.constexpr", "BK: tl.constexpr", "PP: tl.constexpr", "NP: tl.constexpr",
             "EVEN: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        w.lines("pid_m = tl.program_id(0)", "pid_c = tl.program_id(1)", "pid_bh = tl.program_id(2)",
                "nm = tl.num_programs(0)", f"bi = pid_bh // (H // {heads})",
                f"h0 = (pid_bh % (H // {heads})) * {heads}", "g = h0 // HPG", "bi64 = bi.to(tl.int64)")
        emit_positions(w, "s", "pid_m * BM", "BM", q, even=True)
        emit_dims(w, even=True)
        if tma:
            emit_descriptor_rows(w, q, "(H // HPG)")
            w.line("b_s = bd.load([seq0 + pid_m * BM, g * N])")
        else:
            w.line(f"cb_base = ((bi64 * NC + pid_c) * (H // HPG) + g) * {q * q}")
            w.line("b_s = " + seq_tile("b_ptr", "bi64 * sbb + g * sbg", "pos_s", "sbl", "offs_n", "v_s", "m_n"))
        w.comment("targets t in tiles wholly after this row tile factor their decay through r, the")
        w.comment("last position before them:  exp(cs_t - cs_s) = exp(cs_t - cs_r) exp(cs_r - cs_s), both <= 1")
        w.line("dend = (pid_m * BM + BM + BK - 1) // BK * BK")
        w.line(f"rr = tl.minimum(dend, {q}) - 1")
        w.comment("path through the state leaving the chunk: exp(cend - cs_s) = exp(cend - cs_r) exp(cs_r - cs_s)")
        for j in range(heads):
            h = f"h0 + {j}"
            w.line(f"row_{j} = (bi64 * H + {h}) * (NC * {q}) + pid_c * {q}")
            w.line(f"cs_s_{j} = tl.load(cs_ptr + row_{j} + s, mask=in_s, other=0.0)")
            w.line(f"cs_r_{j} = tl.load(cs_ptr + row_{j} + rr)")
            w.line(f"cend = tl.load(cs_ptr + row_{j} + {q - 1})")
            if tma:
                w.line(f"ds = tl.trans(dsd.load([((bi * NC + pid_c) * H + {h}) * P, 0]))")
            else:
                w.line("ds = " + state_tile("dsout_ptr", f"(bi64 * NC + pid_c) * H + {h}", True))
            part = dot(r, 'b_s', f'ds.to({io})')
            if fold:
                part = f"({part} + {fold_dot(r, w, 'b_s', h, True, tma)})"
            w.line(f"acc_{j} = {part} * tl.exp(cend - cs_r_{j})")
        w.comment("intra-chunk path: targets t >= s, first the tiles past r")
        with w.block(f"for k0 in range(dend, {q}, BK):"):
            _dx_targets(w, r, heads, diagonal=False, tma=tma)
        for j in range(heads):
            w.line(f"acc_{j} = acc_{j} * tl.exp(cs_r_{j} - cs_s_{j})[:, None]")
        with w.block("for k0 in range((pid_m * BM) // BK * BK, dend, BK):"):
            _dx_targets(w, r, heads, diagonal=True, tma=tma)
        for j in range(heads):
            _dx_epilogue(w, r, j)
    return w.source()


def _dx_targets(w: Writer, r: SSDRegion, heads: int, diagonal: bool, tma: bool = False) -> None:
    """One target tile t of dx: on the diagonal the full masked decay, past it only the targets'
    factor exp(cs_t - cs_r) (the rows' factor is applied once, before the diagonal)."""
    q = r.chunk_size
    emit_positions(w, "t", "k0", "BK", q, even=True)
    if diagonal:
        w.line("causal = (t[None, :] >= s[:, None]) & v_t[None, :]")
    w.comment("B_s.C_t: a tile of ssd_chunk_cb_both's transposed product, read along its rows")
    if tma:
        w.line("cbt = cbd.load([cb_row + pid_m * BM, k0])")
    else:
        w.line("cbt = " + cb_tile(q, "s[:, None]", "t[None, :]", "in_t[None, :] & in_s[:, None]"))
    for j in range(heads):
        w.line(f"cs_t = tl.load(cs_ptr + row_{j} + t, mask=in_t, other=0.0)")
        if diagonal:
            w.line(f"wj = cbt * tl.exp(tl.where(causal, cs_t[None, :] - cs_s_{j}[:, None], {NEG}))")
        else:
            w.line(f"wj = cbt * tl.exp(cs_t - cs_r_{j})[None, :]")
        if tma:
            w.line(f"dy_t = dyd.load([seq0 + k0, (h0 + {j}) * P])")
        else:
            w.line("dy_t = " + dense_tile("dy_ptr", "pos_t", f"h0 + {j}", "v_t"))
        w.line(f"acc_{j} = {dot(r, to_io(r, 'wj'), 'dy_t', f'acc_{j}')}")


def _dx_epilogue(w: Writer, r: SSDRegion, j: int) -> None:
    h = f"h0 + {j}"
    w.comment(f"epilogue of head {j}")
    w.line("x_s = " + seq_tile("x_ptr", f"bi64 * sxb + ({h}) * sxh", "pos_s", "sxl", "offs_p",
                               "v_s", "m_p") + ".to(tl.float32)")
    w.line(f"tl.store(ddtd_ptr + row_{j} + s, tl.sum(acc_{j} * x_s, 1), mask=in_s)")
    w.line(f"dx = acc_{j} * tl.load(dtp_ptr + row_{j} + s, mask=in_s, other=0.0)[:, None]")
    part = f"((bi64 * NC + pid_c) * nm + pid_m) * H + {h}"
    if r.d_mode != "none":
        w.line("dy_s = " + dense_tile("dy_ptr", "pos_s", h, "v_s") + ".to(tl.float32)")
    if r.d_mode == "head":
        w.line(f"dx += tl.load(d_ptr + {h}).to(tl.float32) * dy_s")
        w.line(f"tl.store(dd_ptr + {part}, tl.sum(tl.sum(dy_s * x_s, 1), 0))")
    elif r.d_mode == "head_dim":
        w.line(f"dx += tl.load(d_ptr + ({h}) * P + offs_p, mask=m_p, other=0.0).to(tl.float32)"
               "[None, :] * dy_s")
        w.line(f"tl.store(dd_ptr + ({part}) * P + offs_p, tl.sum(dy_s * x_s, 0), mask=m_p)")
    w.line(dense_store("dx_ptr", "pos_s", h, "v_s", to_io(r, "dx")))


def render_dbc(r: SSDRegion, which: str, tma: bool = False, fold: bool = False, part: bool = False) -> str:
    """``ssd_dc`` (which="c", target rows) or ``ssd_db`` (which="b", source rows).

    ``tma``: every tile through a tensor descriptor (EVEN launches only): ``ownd`` and ``otherd``
    over this side's and the other side's of B / C as (batch*seqlen, groups*dstate), ``hd`` over
    dy (dc) or x (db) as (batch*seqlen, heads*headdim), ``sd`` over the states (S_in for dc, dS
    for db) as (batch*chunks*heads*headdim, dstate), ``dcbd`` over the dCB parts as
    (splits*batch*chunks*groups*chunk, chunk).  ``fold`` (db only, context parallelism,
    ``ssd_db_fold``): the later ranks' part of dS enters as a second dot (``render_common.fold_dot``).
    ``part`` (dc only, context parallelism, ``ssd_dc_part``): the first row tile of each (chunk,
    head) also writes the later ranks' part of the chunk's total-decay gradient (``_dc_part``)."""
    if which not in ("b", "c"):
        raise ValueError("which must be 'b' or 'c'")
    if fold and which != "b":
        raise ValueError("only db takes a fold")
    if part and which != "c":
        raise ValueError("only dc takes a total-decay part")
    q = r.chunk_size
    name, own, other = (f"ssd_d{which}" + ("_fold" if fold else "") + ("_part" if part else ""), which,
                        ("b" if which == "c" else "c"))
    w = Writer()
    header(w, name, r, f"Backward for {which.upper()} per group (the state path summed over a split's "
           "heads, the pair path from ssd_dcb), and the state path's cumsum-gradient piece.")
    args = ["x_ptr", "b_ptr", "c_ptr", "dy_ptr", "dtp_ptr", "cs_ptr",
            "sin_ptr" if which == "c" else "dsout_ptr"] + (FOLD_ARGS if fold else []) + (
            PART_ARGS if part else []) + ["dcb_ptr", "out_ptr",
            "es_ptr" if which == "c" else "v_ptr", "L", "H", "HPG", "G", "NC", "P", "N",
            "HS", "NS", "DS", "sxb", "sxl", "sxh", "sbb", "sbl", "sbg", "scb", "scl", "scg"]
    args += ["ownd", "hd", "sd", "otherd", "dcbd"] + (["fsd"] if fold else []) if tma else []
    args += ["BT: tl.constexpr", "BS: tl.constexpr", "PP: tl.constexpr", "NP: tl.constexpr",
             "EVEN: tl.constexpr"]
    rows = "t" if which == "c" else "s"
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        w.lines("pid_m = tl.program_id(0)", "pid_c = tl.program_id(1)", "pid_x = tl.program_id(2)",
                "bi = pid_x // (G * HS)", "g = (pid_x % (G * HS)) // HS", "hs = pid_x % HS",
                "bi64 = bi.to(tl.int64)", "hps = HPG // HS", "hbase = g * HPG + hs * hps")
        emit_positions(w, rows, "pid_m * BT", "BT", q, even=True)
        emit_dims(w, even=True)
        if tma:
            emit_descriptor_rows(w, q, "G")
            w.line(f"{own}_r = ownd.load([seq0 + pid_m * BT, g * N])")
        else:
            w.line(f"{own}_r = " + seq_tile(f"{own}_ptr", f"bi64 * s{own}b + g * s{own}g", f"pos_{rows}",
                                            f"s{own}l", "offs_n", f"v_{rows}", "m_n"))
        w.line("acc = tl.zeros((BT, NP), dtype=tl.float32)")
        with w.block("for hh in range(hbase, hbase + hps):"):
            w.line(f"row = (bi64 * H + hh) * (NC * {q}) + pid_c * {q}")
            w.line(f"cs_r = tl.load(cs_ptr + row + {rows}, mask=in_{rows}, other=0.0)")
            if which == "c":
                if part:
                    _dc_part_load(w)
                _dc_state_path(w, r, tma)
                if part:
                    _dc_part(w, r)
            else:
                _db_state_path(w, r, tma, fold)
        _dbc_pairs(w, r, which, other, tma)
        w.line(f"out = out_ptr + ((bi64 * L + pos_{rows}[:, None]) * HS + hs) * G * N + g * N"
               " + offs_n[None, :]")
        w.line(f"tl.store(out, acc, mask=v_{rows}[:, None] & m_n[None, :])")
    return w.source()


def _state_row_tiles(w: Writer, name: str, tile: str, ptr: str, tma: bool) -> None:
    """The head's (rows x headdim) tile ``name`` (``tile`` its pointer form) and its state ``st``."""
    if tma:
        w.lines(f"{name} = hd.load([seq0 + pid_m * BT, hh * P])",
                "st = sd.load([((bi * NC + pid_c) * H + hh) * P, 0])")
    else:
        w.lines(f"{name} = {tile}", "st = " + state_tile(ptr, "(bi64 * NC + pid_c) * H + hh", False))


def _dc_state_path(w: Writer, r: SSDRegion, tma: bool = False) -> None:
    w.comment("path through the state entering the chunk; es = exp(cs_t) dy_t.(S_in C_t)")
    _state_row_tiles(w, "dy_t", dense_tile("dy_ptr", "pos_t", "hh", "v_t"), "sin_ptr", tma)
    w.line(f"e = {dot(r, 'dy_t', f'st.to({r.tl_io})')} * tl.exp(cs_r)[:, None]")
    w.line("acc += e")
    w.line("tl.store(es_ptr + row + t, tl.sum(e * c_r.to(tl.float32), 1), mask=in_t)")


# Context parallelism's part of dC's launch (``runtime/cp_ssd_fused``): the later ranks' gradient
# of this piece's final state, dF_ext, adds gw_c dF_ext to the gradient of the state leaving chunk c
# (gw_c = exp(tot_{c+1} + ... + tot_{nc-1})), hence exp(tot_c) gw_c <S_in,c, dF_ext> to the chunk's
# total-decay gradient.  dC already reads S_in,c, so it forms that sum there: gs (b, h, p, n) in the
# io dtype is dF_ext, gw (b, h, nc) fp32 the weights; the sum is left as P parts, one per row of
# the state (a reduction within each row, no exchange between warps), in columns DT0 .. DT0 + P - 1
# of the decay-gradient rows (b*h, nc, DTS fp32), which the dt backward adds up with the others.
PART_ARGS = ["gs_ptr", "gw_ptr", "dtot_ptr", "DTS", "DT0"]


def _dc_part_load(w: Writer) -> None:
    """dF_ext's tile for head ``hh``, issued before the head's other loads; only the first row tile
    of each chunk reads it (the others' loads are masked off)."""
    w.line("gs = tl.load(gs_ptr + (bi64 * H + hh) * P * N + offs_p[:, None] * N + offs_n[None, :], "
           "mask=m_p[:, None] & (m_n & (offs_n * 0 + pid_m == 0))[None, :], other=0.0)")


def _dc_part(w: Writer, r: SSDRegion) -> None:
    q = r.chunk_size
    with w.block("if pid_m == 0:"):
        w.comment("the later ranks' part of this chunk's total-decay gradient, exp(tot_c) gw_c <S_in, dF_ext>,")
        w.comment("one part per row of the state")
        w.line("gw = tl.load(gw_ptr + (bi64 * H + hh) * NC + pid_c)")
        w.line(f"tot = tl.load(cs_ptr + row + {q - 1})")
        w.line("rows_in = tl.sum(st.to(tl.float32) * gs.to(tl.float32), 1)")
        w.line("tl.store(dtot_ptr + ((bi64 * H + hh) * NC + pid_c) * DTS + DT0 + offs_p, "
               "tl.exp(tot) * gw * rows_in, mask=m_p)")


def _db_state_path(w: Writer, r: SSDRegion, tma: bool = False, fold: bool = False) -> None:
    q = r.chunk_size
    w.comment("path through the state leaving the chunk; v = dt'_s exp(cs_end - cs_s) x_s.(dS B_s)")
    w.line("dt_r = tl.load(dtp_ptr + row + s, mask=in_s, other=0.0)")
    w.line(f"cend = tl.load(cs_ptr + row + {q - 1})")
    _state_row_tiles(w, "x_s", seq_tile("x_ptr", "bi64 * sxb + hh * sxh", "pos_s", "sxl", "offs_p",
                                        "v_s", "m_p"), "dsout_ptr", tma)
    part = dot(r, 'x_s', f'st.to({r.tl_io})')
    if fold:
        part = f"({part} + {fold_dot(r, w, 'x_s', 'hh', False, tma)})"
    w.line(f"f = {part} * (dt_r * tl.exp(cend - cs_r))[:, None]")
    w.line("acc += f")
    w.line("tl.store(v_ptr + row + s, tl.sum(f * b_r.to(tl.float32), 1), mask=in_s)")


def _dbc_pairs(w: Writer, r: SSDRegion, which: str, other: str, tma: bool = False) -> None:
    """Partner tiles: dCB (from ``ssd_dcb``: its NS split parts, DS apart, summed here) times the
    other side's tile; added by the first split of this kernel only."""
    q = r.chunk_size
    part = "s" if which == "c" else "t"
    loop = ("for k0 in range(0, pid_m * BT + BT, BS):" if which == "c"
            else f"for k0 in range((pid_m * BT) // BS * BS, {q}, BS):")
    w.comment("intra-chunk path: " + ("sources s <= t" if which == "c" else "targets t >= s"))
    if not tma:
        w.line(f"cb_base = ((bi64 * NC + pid_c) * G + g) * {q * q}")
    with w.block("if hs == 0:"):
        with w.block(loop):
            emit_positions(w, part, "k0", "BS", q, even=True)
            (_dbc_pair_tiles_tma if tma else _dbc_pair_tiles)(w, which, other, part, q)
            w.line(f"acc = {dot(r, to_io(r, 'dcb'), f'{other}_p', 'acc')}")


def _dbc_pair_tiles(w: Writer, which: str, other: str, part: str, q: int) -> None:
    """The partner loop's tiles through pointers: the other side's B / C rows and dCB as
    (this kernel's rows x partners), its NS split parts summed."""
    w.line(f"{other}_p = " + seq_tile(f"{other}_ptr", f"bi64 * s{other}b + g * s{other}g",
                                      f"pos_{part}", f"s{other}l", "offs_n", f"v_{part}", "m_n"))
    if which == "c":
        at, inside = f"t[:, None] * {q} + s[None, :]", "in_t[:, None] & in_s[None, :]"
    else:
        at, inside = f"t[None, :] * {q} + s[:, None]", "in_t[None, :] & in_s[:, None]"
    w.line(f"dcb = tl.load(dcb_ptr + cb_base + {at}, mask={inside}, other=0.0)")
    with w.block("for sp in range(1, NS):"):
        w.line(f"dcb += tl.load(dcb_ptr + sp * DS + cb_base + {at}, mask={inside}, other=0.0)")


def _dbc_pair_tiles_tma(w: Writer, which: str, other: str, part: str, q: int) -> None:
    """The same through the descriptors: dC reads dCB (t rows, s columns) as stored, dB reads
    (t rows, s columns) tiles and transposes them."""
    w.line(f"{other}_p = otherd.load([seq0 + k0, g * N])")
    at = "pid_m * BT, k0" if which == "c" else "k0, pid_m * BT"
    w.line(f"dcb = dcbd.load([cb_row + {at}])")
    with w.block("for sp in range(1, NS):"):
        w.line(f"dcb += dcbd.load([sp * (DS // {q}) + cb_row + {at}])")
    if which == "b":
        w.line("dcb = tl.trans(dcb)")
