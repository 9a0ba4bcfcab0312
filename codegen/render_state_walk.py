"""The SSD states by one walk over the sequence: ``ssd_state_walk`` (forward) and
``ssd_state_walk_bwd`` (its reverse, in the backward).

One program per (batch*head, headdim tile x dstate tile) walks the whole sequence in blocks of
BT steps, holding its (BP x BN) piece of the state in fp32 registers:

    per block: dt prologue, the dA cumsum (stored for the other kernels),
               S = exp(block's dA sum) S + x_blk^T (B_blk * dt * exp(cs_end - cs))

and at each chunk's first block it stores S, the state entering that chunk (io dtype), before
adding the block; after the last block, the final state (fp32).  This replaces the per-chunk
states and their sequential passing (``ssd_chunk_state`` + ``ssd_state_pass``): the chunk
states never go through memory in fp32, and each step of the walk is one dot on tiles that TMA
prefetches, so it pipelines like a matmul's K loop.  On an H200 at S1 it took 73 us against
127 for the two kernels (benchmarks/NOTES_ssd.md, v12).

Outputs and conventions are the two kernels' (``render_fwd``): the cumsum restarts at every
chunk, states entering each chunk (batch, nchunks, heads, headdim, dstate) in the io dtype, the
final state (batch, heads, headdim, dstate) fp32.  x and B come through tensor descriptors
(``codegen/tma.py``): x as (batch*seqlen, heads*headdim), B as (batch*seqlen, groups*dstate); where a
block is a whole chunk the states leave through one too (``sind``, (batch*chunks*heads*headdim,
dstate)), a TMA store that does not hold up the next block, and elsewhere by masked stores.  So
the walk exists only for EVEN launches (the length a multiple of the chunk, BT dividing it,
power-of-two headdim and dstate).  dt is read by pointer one block ahead of its use (Triton does
not pipeline a pointer load that feeds no dot).

The backward's walk runs the same way from the sequence's end, with dy and C in place of x and B:

    per block (last to first): G = exp(block's dA sum) G + (dy_blk * exp(cs - cs_before))^T C_blk

where G, the gradient of the state at the block's start, begins as the final state's gradient.
At each chunk's last block it stores G, the gradient of the state leaving the chunk (io dtype),
and that chunk's total-decay gradient part exp(cs_end) <S_in, G> (one per program), replacing
the per-chunk ``dy^T C`` reductions and the reverse state passing (``ssd_chunk_dstate`` +
``ssd_state_pass_bwd``); at the start, the initial state's gradient (fp32).
"""
from __future__ import annotations

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import (dot, dt_args, dt_call, emit_dt_helpers, header, load_bias, to_io)
from mambac.codegen.writer import Writer

NAME = "ssd_state_walk"
NAME_BWD = "ssd_state_walk_bwd"


def _emit_program_tiles(w: Writer) -> None:
    """This program's head, group and (BP x BN) state tile (``tile``: its offsets in a state)."""
    w.lines("pid_t = tl.program_id(0)", "pid_bh = tl.program_id(1)", "bi = pid_bh // H",
            "h = pid_bh % H", "g = h // HPG", "bi64 = bi.to(tl.int64)",
            "p0 = (pid_t // (N // BN)) * BP", "n0 = (pid_t % (N // BN)) * BN",
            "offs_p = p0 + tl.arange(0, BP)", "offs_n = n0 + tl.arange(0, BN)",
            "tile = offs_p[:, None] * N + offs_n[None, :]")


def _emit_block(w: Writer, r: SSDRegion, rows: tuple[str, str], decay: str, carry: str) -> None:
    """One block of a walk: the (steps x BP) rows of ``rows[0]`` (x or dy, descriptor ``rows[0]d``)
    scaled by the per-step ``decay`` and dotted with the (steps x BN) tile of ``rows[1]`` (B or C)
    into the carried state ``acc``, which first takes the block's decay; then ``carry``."""
    a, b = rows
    w.lines(f"{a}_s = {a}d.load([seq0 + k, h * P + p0])", f"{b}_s = {b}d.load([seq0 + k, g * N + n0])")
    w.comment("the step weights scale the (steps x BP) rows, not the larger (steps x BN) tile")
    w.line(f"{a}w = " + to_io(r, f"{a}_s.to(tl.float32) * ({decay})[:, None]"))
    w.comment("carry the state across this block, adding the block's own part")
    w.line("acc = " + dot(r, f"tl.trans({a}w)", f"{b}_s", "acc * tl.exp(end - run)"))
    w.line(carry)


def render_state_walk(r: SSDRegion) -> str:
    """``ssd_state_walk``; grid ((P / BP) * (N / BN), batch * heads)."""
    q = r.chunk_size
    w = Writer()
    header(w, NAME, r, "States entering each chunk, by one walk over the sequence per (head, state tile).")
    emit_dt_helpers(w, r)
    args = ["dt_ptr", "a_ptr"] + dt_args(r) + (["init_ptr"] if r.has_initial_state else [])
    args += ["sin_ptr", "final_ptr", "SFB", "dtp_ptr", "cs_ptr", "L", "H", "HPG", "NC", "C_LO", "C_HI",
             "sdb", "sdl", "sdh",
             "xd", "bd", "sind", "BT: tl.constexpr", "BP: tl.constexpr", "BN: tl.constexpr",
             "P: tl.constexpr", "N: tl.constexpr"]
    w.comment("the chunk range is not specialised on: the segments of one walk share a binary")
    w.line('@triton.jit(do_not_specialize=["C_LO", "C_HI"])')
    with w.block(f"def {NAME}({', '.join(args)}):"):
        _emit_program_tiles(w)
        w.line("a = tl.load(a_ptr + h).to(tl.float32)")
        load_bias(w, r, "h")
        w.comment("SFB: the final state's batch stride (a row of a wider buffer: context parallelism's summary,")
        w.comment("whose row holds every head's total log-decay after the states)")
        w.lines("final_at = final_ptr + bi64 * SFB + h * P * N + tile", "summary = SFB > H * P * N",
                "total_at = final_ptr + bi64 * SFB + H * P * N + h")
        if r.has_initial_state:
            w.line("acc = tl.load(init_ptr + (bi64 * H + h) * P * N + tile).to(tl.float32)")
        else:
            w.line("acc = tl.zeros((BP, BN), dtype=tl.float32)")
        w.line("total = a * 0.0  # the walked chunks' total log-decay")
        with w.block("if C_LO > 0:"):
            w.comment("a later segment of the walk: go on from the state (and total) the previous one left")
            w.line("acc = tl.load(final_at)")
            with w.block("if summary:"):
                w.line("total = tl.load(total_at)")
        w.lines("run = a * 0.0  # cumsum of dA since the chunk's start, before this block",
                f"row = (bi64 * H + h) * (NC * {q})", "sin_at = (bi64 * NC * H + h) * P * N + tile",
                "seq0 = bi * L", "k_in = tl.arange(0, BT)",
                "keep = (k_in * 0 + pid_t) == 0  # one state tile stores dt' and the cumsum",
                f"d_next = tl.load(dt_ptr + bi64 * sdb + (C_LO * {q} + k_in) * sdl + h * sdh).to(tl.float32)")
        with w.block(f"for k in range(C_LO * {q}, C_HI * {q}, BT):"):
            w.lines(f"k0 = k % {q}", "d = d_next")
            w.comment("the next block's dt, loaded a block ahead (the last block loads itself again)")
            w.line(f"ahead = tl.minimum(k + BT, C_HI * {q} - BT)")
            w.line("d_next = tl.load(dt_ptr + bi64 * sdb + (ahead + k_in) * sdl + h * sdh).to(tl.float32)")
            w.comment("a chunk's first block: store the state entering the chunk, restart the cumsum")
            with w.block(f"if BT == {q}:"):
                w.comment("one block per chunk (constexpr): every block stores, through the descriptor")
                w.comment("``sind`` (the states as (batch*chunks*heads*headdim, dstate)), off the walk's path")
                w.line(f"sind.store([((bi * NC + k // {q}) * H + h) * P + p0, n0], {to_io(r, 'acc')})")
            with w.block("else:"):
                w.line("first = (offs_n * 0 + k0) == 0")
                w.line(f"tl.store(sin_ptr + sin_at + (k // {q}) * H * P * N, {to_io(r, 'acc')}, "
                       "mask=(offs_p >= 0)[:, None] & first[None, :])")
            w.line("run = tl.where(k0 == 0, 0.0, run)")
            w.line(f"d = {dt_call(r, 'd')}")
            w.lines("da = d * a", "cs = run + tl.cumsum(da, 0)", "end = run + tl.sum(da, 0)",
                    "tl.store(dtp_ptr + row + k + k_in, d, mask=keep)",
                    "tl.store(cs_ptr + row + k + k_in, cs, mask=keep)")
            _emit_block(w, r, ("x", "b"), "d * tl.exp(end - cs)", "run = end")
            w.line(f"total += tl.where(k0 == {q} - BT, end, 0.0)")
        w.comment("the state leaving the walked chunks: the final state after the last segment")
        w.line("tl.store(final_at, acc)")
        with w.block("if summary:"):
            w.line("tl.store(total_at + k_in * 0, total + k_in * 0.0, mask=keep & (k_in == 0))")
    return w.source()


def render_state_walk_bwd(r: SSDRegion) -> str:
    """``ssd_state_walk_bwd``; grid ((P / BP) * (N / BN), batch * heads).  dtot gets one part
    per (batch*head, chunk, program of the head), its rows DTS apart (room for more parts after
    them)."""
    q = r.chunk_size
    w = Writer()
    header(w, NAME_BWD, r, "Gradients of the states leaving each chunk, by one reverse walk per (head, state tile).")
    args = ["cs_ptr", "sin_ptr", "dfinal_ptr", "dsout_ptr", "dinit_ptr", "dtot_ptr", "L", "H", "HPG", "NC",
            "DTS", "dyd", "cd", "BT: tl.constexpr", "BP: tl.constexpr", "BN: tl.constexpr",
            "P: tl.constexpr", "N: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {NAME_BWD}({', '.join(args)}):"):
        _emit_program_tiles(w)
        w.lines("bh64 = pid_bh.to(tl.int64)",
                "acc = tl.load(dfinal_ptr + bh64 * P * N + tile).to(tl.float32)",
                f"row = bh64 * (NC * {q})", "sin_at = (bi64 * NC * H + h) * P * N + tile",
                "seq0 = bi * L", "k_in = tl.arange(0, BT)", f"last = NC * {q} - BT",
                "cs_cur = tl.load(cs_ptr + row + last + k_in)")
        with w.block(f"for kk in range(0, NC * {q}, BT):"):
            w.lines("k = last - kk", f"k0 = k % {q}", f"c = k // {q}")
            w.comment("the earlier block's cumsum, loaded a block ahead; its last entry is this block's start")
            w.line("cs_prev = tl.load(cs_ptr + row + tl.maximum(k - BT, 0) + k_in)")
            w.line("end = tl.sum(tl.where(k_in == BT - 1, cs_cur, 0.0), 0)")
            w.line("run = tl.where(k0 == 0, 0.0, tl.sum(tl.where(k_in == BT - 1, cs_prev, 0.0), 0))")
            w.comment("a chunk's last block: G is the gradient of the state leaving the chunk")
            w.line(f"at_end = (offs_n * 0 + k0) == {q} - BT")
            w.line("m_end = (offs_p >= 0)[:, None] & at_end[None, :]")
            w.line(f"tl.store(dsout_ptr + sin_at + c * H * P * N, {to_io(r, 'acc')}, mask=m_end)")
            w.line("s_in = tl.load(sin_ptr + sin_at + c * H * P * N, mask=m_end, other=0.0).to(tl.float32)")
            w.line("part = tl.exp(end) * tl.sum(tl.sum(s_in * acc, 1), 0)")
            w.line("tl.store(dtot_ptr + (bh64 * NC + c) * DTS + pid_t + k_in * 0, part + k_in * 0.0, "
                   f"mask=(k_in == 0) & ((k_in * 0 + k0) == {q} - BT))")
            _emit_block(w, r, ("dy", "c"), "tl.exp(cs_cur - run)", "cs_cur = cs_prev")
        w.line("tl.store(dinit_ptr + bh64 * P * N + tile, acc)")
    return w.source()
