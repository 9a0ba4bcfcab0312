"""Renderer of ``ssd_fused_fwd``: the chunk state, the state passing and the chunk scan in one launch.

One program owns one chunk of one (batch, head) and does, in order:

1. the dt prologue, the dA cumsum (stored for the backward) and the chunk's own state
   sum_s x_s B_s^T dt'_s exp(cs_end - cs_s), in fp32 registers (as ``ssd_chunk_state``);
2. the hand-over: it waits until the program of the previous chunk of the same (batch, head) has
   published the state leaving that chunk, reads it (that is this chunk's S_in), publishes
   exp(cs_end) S_in + own state for the next chunk and raises the (batch, head)'s flag;
3. the chunk's output, row tile by row tile, from S_in held in registers (as ``ssd_chunk_scan``).

No chunk state goes through memory except the hand-over, which lives in a two-slot ring per
(batch, head) that stays in L2: the program of chunk c writes slot c % 2 only after it has read
slot (c - 1) % 2, and the program of chunk c + 1 reads it only after c's flag is up, so a slot is
never overwritten before its reader is done.

Programs take their chunk from a ticket counter (one atomic add at the start), chunk-major, so
the program a chunk waits for always took an earlier ticket and is already running: the waits
cannot deadlock whatever order the hardware starts programs in.  The launcher zeroes the counter
and the flags before every launch.
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import (dt_args, emit_dims, emit_dt_helpers, emit_positions, header,
                                          load_bias, to_io)
from mambac.codegen.render_fwd import chunk_state_block, emit_scan_rows
from mambac.codegen.writer import Writer

NAME = "ssd_fused_fwd"


def render_fused_forward(r: SSDRegion) -> str:
    q = r.chunk_size
    w = Writer()
    header(w, NAME, r, "Chunk state, state passing (flag hand-over between chunk programs) and chunk "
           "scan in one launch, one (chunk, batch*head) per program.")
    emit_dt_helpers(w, r)
    args = ["x_ptr", "dt_ptr", "a_ptr", "b_ptr"] + dt_args(r) + ["cb_ptr", "c_ptr"]
    args += ["z_ptr"] if r.has_z else []
    args += ["d_ptr"] if r.d_mode != "none" else []
    args += ["y_ptr", "dtp_ptr", "cs_ptr", "sin_ptr"] + (["init_ptr"] if r.has_initial_state else [])
    args += ["final_ptr", "ring_ptr", "sync_ptr", "BH", "L", "H", "HPG", "NC", "P", "N",
             "sxb", "sxl", "sxh", "sdb", "sdl", "sdh", "sbb", "sbl", "sbg", "scb", "scl", "scg"]
    args += ["szb", "szl", "szh"] if r.has_z else []
    args += ["BM: tl.constexpr", "BK: tl.constexpr", "PP: tl.constexpr", "NP: tl.constexpr",
             "SAVE: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {NAME}({', '.join(args)}):"):
        w.comment("chunk-major tickets: the chunk this program waits for took an earlier one")
        w.lines("ticket = tl.atomic_add(sync_ptr, 1)", "pid_c = ticket // BH", "pid_bh = ticket % BH",
                "bi = pid_bh // H", "h = pid_bh % H", "h0 = h", "g = h // HPG", "bi64 = bi.to(tl.int64)")
        emit_dims(w)
        w.lines(f"row = (bi64 * H + h) * (NC * {q}) + pid_c * {q}",
                "acc = tl.zeros((PP, NP), dtype=tl.float32)", "a = tl.load(a_ptr + h).to(tl.float32)")
        load_bias(w, r, "h")
        w.lines(f"lim = {q}", "run = a * 0.0  # cumsum of dA before this block")
        w.comment("1. the chunk's own state (BK steps per block)")
        with w.block(f"for k0 in range(0, {q}, BK):"):
            emit_positions(w, "s", "k0", "BK", q)
            chunk_state_block(w, r, q)
        _hand_over(w, r)
        _scan_rows(w, r)
    return w.source()


def _scan_rows(w: Writer, r: SSDRegion) -> None:
    """Step 3: the chunk scan of every row tile of this chunk, S_in from registers."""
    q = r.chunk_size
    w.comment("3. the output, row tile by row tile, from S_in in registers")
    w.line(f"st = {to_io(r, 'tl.trans(prev)')}")
    w.lines(f"cb_base = ((bi64 * NC + pid_c) * (H // HPG) + g) * {q * q}",
            f"rows = tl.minimum(L - pid_c * {q}, {q})  # no row tiles wholly past the sequence")
    with w.block("for m0 in range(0, rows, BM):"):
        emit_scan_rows(w, r, 1, "m0", "forward", lambda j: "st")


def _hand_over(w: Writer, r: SSDRegion) -> None:
    """Step 2: wait for the previous chunk's state, publish this chunk's, keep S_in as ``prev``."""
    w.comment("2. hand-over: wait until the previous chunk's program has published its leaving state")
    w.lines("flag = sync_ptr + 1 + pid_bh", "seen = tl.atomic_add(flag, 0, sem=\"acquire\")")
    with w.block("while seen < pid_c:"):
        w.line("seen = tl.atomic_add(flag, 0, sem=\"acquire\")")
    w.lines("pn = offs_p[:, None] * N + offs_n[None, :]", "m_pn = m_p[:, None] & m_n[None, :]",
            "ring = ring_ptr + pid_bh.to(tl.int64) * 2 * P * N")
    w.line("prev = tl.zeros((PP, NP), dtype=tl.float32)")
    with w.block("if pid_c > 0:"):
        w.comment("read past L1 (.cg): the slot was written by another multiprocessor")
        w.line("prev = tl.load(ring + ((pid_c + 1) % 2) * P * N + pn, mask=m_pn, other=0.0, "
               "cache_modifier=\".cg\")")
    if r.has_initial_state:
        with w.block("else:"):
            w.line("prev = tl.load(init_ptr + pid_bh.to(tl.int64) * P * N + pn, mask=m_pn, other=0.0)"
                   ".to(tl.float32)")
    w.line("sout = prev * tl.exp(run) + acc")
    w.line("tl.store(ring + (pid_c % 2) * P * N + pn, sout, mask=m_pn)")
    with w.block("if pid_c == NC - 1:"):
        w.line("tl.store(final_ptr + pid_bh.to(tl.int64) * P * N + pn, sout, mask=m_pn)")
    w.comment("every thread's part of the state (and of dt', cs) is written before the flag goes up")
    w.line("tl.debug_barrier()")
    w.line("tl.atomic_xchg(flag, pid_c + 1, sem=\"release\")")
    with w.block("if SAVE:"):
        w.line(f"tl.store(sin_ptr + ((bi64 * NC + pid_c) * H + h) * P * N + pn, {to_io(r, 'prev')}, "
               "mask=m_pn)")
