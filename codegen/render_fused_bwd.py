"""Renderer of ``ssd_dstate_pass``: the backward's per-chunk dy^T C reduction and the reverse state
passing in one launch (``ssd_chunk_dstate`` + ``ssd_state_pass_bwd`` as one kernel).

One program owns one chunk of one (batch, head), chunks taken in reverse through the tickets and
flags of ``render_fused`` (the same two-slot ring per (batch, head)):

1. its own gradient state  sum_t exp(cs_t) dy_t^T C_t  in fp32 registers;
2. it waits for the program of the next chunk, whose published value is dS, the gradient of the
   state leaving this chunk (the last chunk takes d final_state instead), and publishes
   exp(cs_end) dS + own for the previous chunk (the first chunk's is d initial_state);
3. it stores dS in the io dtype for ``ssd_dx`` / ``ssd_db`` and the total-decay gradient
   exp(cs_end) <S_in, dS> for ``ssd_dt_backward`` (one part per chunk).
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import emit_dims, emit_positions, header, to_io
from mambac.codegen.render_fused import emit_ticket, emit_wait
from mambac.codegen.render_fwd import chunk_dstate_block
from mambac.codegen.writer import Writer

NAME = "ssd_dstate_pass"


def render_dstate_pass(r: SSDRegion) -> str:
    q = r.chunk_size
    w = Writer()
    header(w, NAME, r, "Per-chunk gradient state and reverse state passing (flag hand-over between "
           "chunk programs) in one launch, one (chunk, batch*head) per program.")
    args = ["dy_ptr", "c_ptr", "cs_ptr", "sin_ptr", "dfinal_ptr", "dsout_ptr", "dinit_ptr", "dtot_ptr",
            "ring_ptr", "sync_ptr", "BH", "L", "H", "HPG", "NC", "P", "N", "scb", "scl", "scg",
            "BK: tl.constexpr", "PP: tl.constexpr", "NP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {NAME}({', '.join(args)}):"):
        emit_ticket(w, reverse=True)
        emit_dims(w)
        w.lines(f"row = (bi64 * H + h) * (NC * {q}) + pid_c * {q}",
                "acc = tl.zeros((PP, NP), dtype=tl.float32)")
        w.comment("1. this chunk's own gradient state (BK steps per block)")
        with w.block(f"for k0 in range(0, {q}, BK):"):
            emit_positions(w, "s", "k0", "BK", q)
            chunk_dstate_block(w, r, q)
        w.comment("2. hand-over: dS leaving this chunk comes from the next chunk's program")
        emit_wait(w, "step")
        w.line("ds = tl.zeros((PP, NP), dtype=tl.float32)")
        with w.block("if step > 0:"):
            w.comment("read past L1 (.cg): the slot was written by another multiprocessor")
            w.line("ds = tl.load(ring + ((step + 1) % 2) * P * N + pn, mask=m_pn, other=0.0, "
                   "cache_modifier=\".cg\")")
        with w.block("else:"):
            w.line("ds = tl.load(dfinal_ptr + pid_bh.to(tl.int64) * P * N + pn, mask=m_pn, other=0.0)")
        w.lines(f"dec = tl.exp(tl.load(cs_ptr + row + {q - 1}))", "nxt = ds * dec + acc",
                "tl.store(ring + (step % 2) * P * N + pn, nxt, mask=m_pn)")
        w.comment("every thread's part is written before the flag goes up")
        w.lines("tl.debug_barrier()", "tl.atomic_xchg(flag, step + 1, sem=\"release\")")
        with w.block("if pid_c == 0:"):
            w.line("tl.store(dinit_ptr + pid_bh.to(tl.int64) * P * N + pn, nxt, mask=m_pn)")
        w.comment("3. dS for dx and dB; the total-decay gradient for the dt backward")
        w.lines("idx = ((bi64 * NC + pid_c) * H + h) * P * N",
                f"tl.store(dsout_ptr + idx + pn, {to_io(r, 'ds')}, mask=m_pn)",
                "s_in = tl.load(sin_ptr + idx + pn, mask=m_pn, other=0.0).to(tl.float32)",
                "tl.store(dtot_ptr + pid_bh.to(tl.int64) * NC + pid_c, dec * tl.sum(tl.sum(s_in * ds, 1), 0))")
    return w.source()
