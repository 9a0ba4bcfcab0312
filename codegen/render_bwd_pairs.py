"""Renderer of ``ssd_dcb``: the SSD backward's pair weights, once for both dB and dC.

Per head, inside one chunk (notation of ``render_bwd_tiles``), the intra-chunk gradients of B
and C go through the pair weights W_ts = (dy_t.x_s) L_ts dt'_s, summed over a group's heads:

    dC_t += sum_s dCB_ts B_s,   dB_s += sum_t dCB_ts C_t,   dCB_ts = sum_h W^h_ts

One program owns a (t tile, s tile) pair of one chunk and group and walks one split of the
group's heads (splits give the GPU more programs; ``ssd_dc``/``ssd_db`` add the splits' parts up
as they load them).  It writes its part of dCB for that pair (fp32, (split, batch, chunk, group,
q, q); pairs above the diagonal get zeros, so the readers load whole tiles), and, per head, the two sums of the fp32 pair terms
M_ts = W_ts (C_t.B_s) that the cumsum gradient needs: the row sums (slot = s tile) and the column
sums (slot = t tile), both from the same values, so their cancellation in ``ssd_dt_backward``
happens in fp32 arithmetic.  Each dy_t.x_s product is formed once (it used to be formed in
both the dC and the dB kernel, for every partner tile of each).
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import (NEG, dense_tile, dot, emit_descriptor_rows, emit_positions,
                                          header, seq_tile)
from mambac.codegen.render_fwd import cb_tile
from mambac.codegen.writer import Writer

NAME = "ssd_dcb"


def render_dcb(r: SSDRegion, unroll: int = 1, tma: bool = False) -> str:
    """``unroll`` heads per step of the head loop (it must divide the heads per split); ``tma``:
    x, dy and C B^T through tensor descriptors (``xd`` and ``dyd`` as (batch*seqlen,
    heads*headdim), ``cbd`` as (batch*chunks*groups*chunk, chunk)), only for EVEN launches."""
    q = r.chunk_size
    w = Writer()
    header(w, NAME, r, f"Pair weights summed over a group's heads, and their cumsum-gradient sums; "
           f"{unroll} head(s) per loop step.")
    args = ["x_ptr", "dy_ptr", "dtp_ptr", "cs_ptr", "cb_ptr", "dcb_ptr", "mrow_ptr", "mcol_ptr",
            "L", "H", "HPG", "G", "NC", "P", "HS", "DS", "sxb", "sxl", "sxh"]
    args += (["xd", "dyd", "cbd"] if tma else []) + ["BT: tl.constexpr", "PP: tl.constexpr",
                                                      "EVEN: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {NAME}({', '.join(args)}):"):
        w.lines(f"nt = {q} // BT + ({q} % BT > 0)", "pid_m = tl.program_id(0) // nt",
                "pid_k = tl.program_id(0) % nt", "pid_c = tl.program_id(1)", "pid_x = tl.program_id(2)",
                "bi = pid_x // (G * HS)", "g = (pid_x % (G * HS)) // HS", "hs = pid_x % HS",
                "bi64 = bi.to(tl.int64)", "hps = HPG // HS", "hbase = g * HPG + hs * hps",
                "offs_p = tl.arange(0, PP)", "m_p = (offs_p < P) | EVEN")
        emit_positions(w, "t", "pid_m * BT", "BT", q, even=True)
        emit_positions(w, "s", "pid_k * BT", "BT", q, even=True)
        w.lines(f"cb_base = ((bi64 * NC + pid_c) * G + g) * {q * q}",
                "inside = in_t[:, None] & in_s[None, :]")
        if tma:
            emit_descriptor_rows(w, q, "G")
        w.comment("below the diagonal the decay factors through r, the s tile's last position:")
        w.comment("exp(cs_t - cs_s) = exp(cs_t - cs_r) exp(cs_r - cs_s), both <= 1")
        for diagonal, cond in ((False, "if pid_k < pid_m:"), (True, "elif pid_k == pid_m:")):
            with w.block(cond):
                if diagonal:
                    w.line("causal = (t[:, None] >= s[None, :]) & v_s[None, :]")
                if tma:
                    w.line("cb = cbd.load([cb_row + pid_m * BT, pid_k * BT])")
                else:
                    w.line("cb = " + cb_tile(q, "t[:, None]", "s[None, :]", "inside"))
                w.line("wsum = tl.zeros((BT, BT), dtype=tl.float32)")
                with w.block(f"for h0 in range(hbase, hbase + hps, {unroll}):"):
                    for j in range(unroll):
                        _pair_head(w, r, f"h0 + {j}", diagonal, tma)
        with w.block("else:"):
            w.line("wsum = tl.zeros((BT, BT), dtype=tl.float32)")
        w.line(f"tl.store(dcb_ptr + hs.to(tl.int64) * DS + cb_base + t[:, None] * {q} + s[None, :], wsum, "
               "mask=inside)")
    return w.source()


def _pair_head(w: Writer, r: SSDRegion, hh: str, diagonal: bool, tma: bool = False) -> None:
    q = r.chunk_size
    w.line(f"row = (bi64 * H + {hh}) * (NC * {q}) + pid_c * {q}")
    w.line("cs_t = tl.load(cs_ptr + row + t, mask=in_t, other=0.0)")
    w.line("cs_s = tl.load(cs_ptr + row + s, mask=in_s, other=0.0)")
    w.line("dt_s = tl.load(dtp_ptr + row + s, mask=in_s, other=0.0)")
    if tma:
        w.line(f"dy_t = dyd.load([seq0 + pid_m * BT, ({hh}) * P])")
        w.line(f"x_s = xd.load([seq0 + pid_k * BT, ({hh}) * P])")
    else:
        w.line("dy_t = " + dense_tile("dy_ptr", "pos_t", hh, "v_t"))
        w.line("x_s = " + seq_tile("x_ptr", f"bi64 * sxb + ({hh}) * sxh", "pos_s", "sxl", "offs_p",
                                   "v_s", "m_p"))
    if diagonal:
        w.line(f"wj = {dot(r, 'dy_t', 'tl.trans(x_s)')} * tl.exp(tl.where(causal, cs_t[:, None] - cs_s[None, :], "
               f"{NEG})) * dt_s[None, :]")
    else:
        w.line("cs_r = tl.load(cs_ptr + row + pid_k * BT + BT - 1)")
        w.line(f"wj = {dot(r, 'dy_t', 'tl.trans(x_s)')} * tl.exp(cs_t - cs_r)[:, None]"
               " * (tl.exp(cs_r - cs_s) * dt_s)[None, :]")
    w.line("wsum += wj")
    w.line("m = wj * cb")
    w.comment("row sums into slot pid_k (the s tile), column sums into slot pid_m (the t tile)")
    w.line("tl.store(mrow_ptr + (row + t) * nt + pid_k, tl.sum(m, 1), mask=in_t)")
    w.line("tl.store(mcol_ptr + (row + s) * nt + pid_m, tl.sum(m, 0), mask=in_s)")
