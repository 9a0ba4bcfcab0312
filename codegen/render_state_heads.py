"""The forward's per-chunk states for several heads of one group per program.

``ssd_chunk_state`` with ``heads`` > 1: the heads' rows are stacked into one (heads*headdim x
steps) operand, so the group's B tile of each step block is loaded once for all of them and one
dot of heads*headdim rows replaces a dot per head.  Per-head values (dt, the dA cumsum, the decay
weights) are (heads x steps) tiles, spread over their headdim rows by ``_rows``.  On an H200
(benchmarks/NOTES_ssd.md, v9) two heads per program with 64-step blocks took the chunk states
from 99 to 89 us at S1 and from 143 to 126 at S2; the backward's dstate in the same form was
slower than one head per program (73 against 70 us at S1), so it keeps the one-head form.

Same outputs and conventions as the one-head form (``render_fwd``): states (batch, nchunks,
heads, headdim, dstate) fp32, dt' and the cumsum (batch, heads, nchunks*chunk) fp32.  The heads
of one program must share a group (``heads`` divides heads per group).
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import (dt_args, emit_descriptor_rows, emit_dt_helpers, emit_positions,
                                          header)
from mambac.codegen.render_fwd import chunk_state_block
from mambac.codegen.writer import Writer


def emit_rows_helper(w: Writer) -> None:
    """``_rows``: a (heads x k) tile of per-head values -> (heads*BP x k), each head's row
    repeated over its BP headdim rows (the stacked operand's row order)."""
    w.line("@triton.jit")
    with w.block("def _rows(v, BP: tl.constexpr):"):
        w.line('"""(HB x K) per-head values -> (HB*BP x K), head j on rows j*BP .. j*BP + BP - 1."""')
        w.line("HB: tl.constexpr = v.shape[0]")
        w.line("K: tl.constexpr = v.shape[1]")
        w.line("return tl.reshape(tl.broadcast_to(v[:, None, :], (HB, BP, K)), (HB * BP, K))")
    w.lines("", "")


def render_chunk_state_heads(r: SSDRegion, heads: int, tma: bool = False) -> str:
    """``ssd_chunk_state`` for ``heads`` heads per program; grid (chunks, batch * heads /
    ``heads``), BP the padded headdim; ``tma`` as ``render_fwd.render_chunk_state``'s."""
    q = r.chunk_size
    w = Writer()
    header(w, "ssd_chunk_state", r, f"Per-chunk state for {heads} heads per program: prologue + dA "
           "cumsum + x^T (B * decay-to-end * dt).")
    emit_dt_helpers(w, r)
    emit_rows_helper(w)
    args = ["x_ptr", "dt_ptr", "a_ptr", "b_ptr"] + dt_args(r) + ["states_ptr", "dtp_ptr", "cs_ptr"]
    args += ["L", "H", "HPG", "NC", "P", "N", "sxb", "sxl", "sxh", "sdb", "sdl", "sdh",
             "sbb", "sbl", "sbg"] + (["xd", "bd"] if tma else [])
    args += ["BT: tl.constexpr", "BP: tl.constexpr", "NP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def ssd_chunk_state({', '.join(args)}):"):
        w.lines("pid_c = tl.program_id(0)", "pid_bh = tl.program_id(1)",
                f"bi64 = (pid_bh // (H // {heads})).to(tl.int64)",
                f"h0 = (pid_bh % (H // {heads})) * {heads}", "g = h0 // HPG",
                f"hh = tl.arange(0, {heads})",
                f"rows = tl.arange(0, {heads} * BP)", "r_h = rows // BP", "r_p = rows % BP", "m_r = r_p < P",
                "offs_n = tl.arange(0, NP)", "m_n = offs_n < N",
                f"row = (bi64 * H + h0 + hh) * (NC * {q}) + pid_c * {q}",
                f"acc = tl.zeros(({heads} * BP, NP), dtype=tl.float32)",
                "a = tl.load(a_ptr + h0 + hh).to(tl.float32)")
        if tma:
            emit_descriptor_rows(w, q, batch=f"(pid_bh // (H // {heads}))")
        if r.has_dt_bias:
            w.line("bias = tl.load(bias_ptr + h0 + hh).to(tl.float32)[:, None]")
        w.line("run = a * 0.0  # per head: cumsum of dA before this block")
        with w.block(f"for k0 in range(0, {q}, BT):"):
            emit_positions(w, "s", "k0", "BT", q)
            chunk_state_block(w, r, q, stacked=True, tma=tma)
        w.line("tl.store(states_ptr + ((bi64 * NC + pid_c) * H + h0) * P * N + (r_h * P + r_p)[:, None] * N"
               " + offs_n[None, :], acc, mask=m_r[:, None] & m_n[None, :])")
    return w.source()
