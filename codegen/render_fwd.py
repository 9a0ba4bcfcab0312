"""Renderers of the SSD forward kernels (and of their two shapes reused by the backward).

Forward = four launches:

* ``ssd_chunk_cb``     per (tile pair, chunk, batch*group): CB_ts = C_t.B_s inside each chunk, in
  fp32 (zeros above the diagonal).  B and C are shared by a group's heads, so the chunk scan (and
  the backward's dx) read this product instead of forming it again for every head.
* ``ssd_chunk_state``  per (chunk, batch*head, headdim tile): dt prologue, dA cumsum (stored for
  the other kernels), and the chunk's own state  sum_s x_s B_s^T dt_s exp(cs_end - cs_s).
* ``ssd_state_pass``   per (batch*head, state tile), sequential over chunks: the state entering
  each chunk (initial state in, final state out).
* ``ssd_chunk_scan``   per (row tile, chunk, batch*head block): y = exp(cs_t) C_t S_in
  + sum_{s<=t} (C_t.B_s) exp(cs_t - cs_s) dt_s x_s, then the D skip and the z gate, for
  ``heads`` heads of one group per program (unrolled).

``ssd_chunk_cb`` fills tile pairs above the diagonal with zeros (no matmul), so every reader may
load whole tiles.  ``ssd_chunk_state`` in mode "dstate" is the backward's  sum_t exp(cs_t) dy_t C_t^T, and
``ssd_chunk_scan`` in mode "gate_backward" recomputes y to give dz and the gated dy.
"""
from __future__ import annotations

from typing import Callable, Optional

from mambac.codegen.kernel_ir import SSDRegion
from mambac.codegen.render_common import (FOLD_ARGS, NEG, dense_store, dense_tile, dot, dt_args, dt_call,
                                          emit_descriptor_rows, emit_dims, emit_dt_helpers,
                                          emit_positions, fold_dot, header, inside,
                                          load_bias, seq_tile, state_tile, to_io)
from mambac.codegen.writer import Writer

CHUNK_STATE_MODES = ("forward", "dstate")
CHUNK_SCAN_MODES = ("forward", "gate_backward")


def chunk_state_name(mode: str) -> str:
    return "ssd_chunk_state" if mode == "forward" else "ssd_chunk_dstate"


def render_chunk_state(r: SSDRegion, mode: str = "forward", heads: int = 1, tma: bool = False) -> str:
    """Kernel 1 (forward) or the backward's per-chunk dstate reduction (mode "dstate"); with
    ``heads`` > 1 the forward's form that stacks several heads of a group per program
    (``render_state_heads``).  ``tma``: the x (or dy) and B (or C) tiles through tensor
    descriptors ``xd`` / ``bd`` (dstate: ``dyd`` / ``cd``), x and dy as (batch*seqlen,
    heads*headdim), B and C as (batch*seqlen, groups*dstate); only for launches whose step blocks
    stay inside the sequence's chunks (EVEN)."""
    if mode not in CHUNK_STATE_MODES:
        raise ValueError(f"mode must be one of {CHUNK_STATE_MODES}")
    if heads > 1:
        if mode != "forward":
            raise ValueError("only the forward's chunk states stack several heads per program")
        from mambac.codegen.render_state_heads import render_chunk_state_heads  # it uses this module
        return render_chunk_state_heads(r, heads, tma)
    fwd = mode == "forward"
    name, q = chunk_state_name(mode), r.chunk_size
    w = Writer()
    header(w, name, r, "Per-chunk state: prologue + dA cumsum + x^T (B * decay-to-end * dt)." if fwd
           else "Per-chunk gradient state: dy^T (C * exp(cs)).")
    if fwd:
        emit_dt_helpers(w, r)
        args = ["x_ptr", "dt_ptr", "a_ptr", "b_ptr"] + dt_args(r) + ["states_ptr", "dtp_ptr", "cs_ptr"]
        args += ["L", "H", "HPG", "NC", "P", "N", "sxb", "sxl", "sxh", "sdb", "sdl", "sdh",
                 "sbb", "sbl", "sbg"]
    else:
        args = ["dy_ptr", "c_ptr", "cs_ptr", "dst_ptr", "L", "H", "HPG", "NC", "P", "N",
                "scb", "scl", "scg"]
    args += (["xd", "bd"] if fwd else ["dyd", "cd"]) if tma else []
    args += ["BT: tl.constexpr", "BP: tl.constexpr", "NP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        w.lines("pid_c = tl.program_id(0)", "pid_bh = tl.program_id(1)", "pid_p = tl.program_id(2)",
                "bi = pid_bh // H", "h = pid_bh % H", "g = h // HPG", "bi64 = bi.to(tl.int64)",
                "offs_p = pid_p * BP + tl.arange(0, BP)", "m_p = offs_p < P",
                "offs_n = tl.arange(0, NP)", "m_n = offs_n < N",
                f"row = (bi64 * H + h) * (NC * {q}) + pid_c * {q}",
                "acc = tl.zeros((BP, NP), dtype=tl.float32)")
        if tma:
            emit_descriptor_rows(w, q)
        if fwd:
            w.line("a = tl.load(a_ptr + h).to(tl.float32)")
            load_bias(w, r, "h")
            w.line(f"lim = tl.where(pid_p == 0, {q}, 0)  # one headdim tile stores dt' and the cumsum")
            w.line("run = a * 0.0  # cumsum of dA before this block")
        with w.block(f"for k0 in range(0, {q}, BT):"):
            emit_positions(w, "s", "k0", "BT", q)
            if fwd:
                chunk_state_block(w, r, q, tma=tma)
            else:
                chunk_dstate_block(w, r, q, tma)
        out = "states_ptr" if fwd else "dst_ptr"
        w.line(f"tl.store({out} + ((bi64 * NC + pid_c) * H + h) * P * N + offs_p[:, None] * N"
               " + offs_n[None, :], acc, mask=m_p[:, None] & m_n[None, :])")
    return w.source()


def chunk_state_block(w: Writer, r: SSDRegion, q: int, stacked: bool = False, tma: bool = False) -> None:
    """One block of BT steps of a chunk's state: dt prologue, the running dA cumsum (stored where
    ``lim`` allows), and the rescaled x^T (B w).  ``stacked``: the (heads x steps) form of
    ``render_state_heads``, whose x rows are several heads' stacked (per-head values spread over
    their rows by ``_rows``; every block stores dt' and the cumsum).  ``tma``: x and B through
    the descriptors ``xd`` and ``bd`` (the stacked heads are adjacent columns of x's rows)."""
    if stacked:
        w.line("d = tl.load(dt_ptr + bi64 * sdb + pos_s[None, :] * sdl + (h0 + hh)[:, None] * sdh, "
               "mask=v_s[None, :], other=0.0).to(tl.float32)")
        valid, a, ax, run = "v_s[None, :]", "a[:, None]", 1, "run[:, None]"
        at, keep = "row[:, None] + s[None, :]", f"(s < {q})[None, :]"
        x_s = ("tl.load(x_ptr + bi64 * sxb + (h0 + r_h)[:, None] * sxh + pos_s[None, :] * sxl"
               " + r_p[:, None], mask=v_s[None, :] & m_r[:, None], other=0.0)")
        weight = "_rows(d * tl.exp(end[:, None] - cs), BP)"
        rescale = "_rows(tl.exp(end - run)[:, None], BP)"
    else:
        w.line("d = tl.load(dt_ptr + bi64 * sdb + pos_s * sdl + h * sdh, mask=v_s, other=0.0)"
               ".to(tl.float32)")
        valid, a, ax, run, at, keep = "v_s", "a", 0, "run", "row + s", "s < lim"
        x_s = seq_tile("x_ptr", "bi64 * sxb + h * sxh", "pos_s", "sxl", "offs_p", "v_s", "m_p",
                       transpose=True)
        weight, rescale = "(d * tl.exp(end - cs))[None, :]", "tl.exp(end - run)"
    w.comment("prologue, then zero outside the sequence so padded steps neither add nor decay")
    w.line(f"d = tl.where({valid}, {dt_call(r, 'd')}, 0.0)")
    w.lines(f"da = d * {a}", f"cs = {run} + tl.cumsum(da, {ax})", f"end = run + tl.sum(da, {ax})",
            f"tl.store(dtp_ptr + {at}, d, mask={keep})", f"tl.store(cs_ptr + {at}, cs, mask={keep})")
    if tma:
        x_s = "tl.trans(xd.load([seq0 + k0, " + ("h0 * P]))" if stacked else "h * P + pid_p * BP]))")
    w.line("x_s = " + x_s)
    if tma:
        w.line("b_s = bd.load([seq0 + k0, g * N])")
    else:
        w.line("b_s = " + seq_tile("b_ptr", "bi64 * sbb + g * sbg", "pos_s", "sbl", "offs_n", "v_s", "m_n"))
    w.comment("the step weights scale x (rows x BT), not the larger B tile, which goes to the dot as loaded")
    w.line("xw = " + to_io(r, f"x_s.to(tl.float32) * {weight}"))
    w.comment("rescale what earlier blocks added to this block's end, then add this block")
    w.line("acc = " + dot(r, "xw", "b_s", f"acc * {rescale}"))
    w.line("run = end")


def chunk_dstate_block(w: Writer, r: SSDRegion, q: int, tma: bool = False) -> None:
    w.line(f"cs = tl.load(cs_ptr + row + s, mask=s < {q}, other=0.0)")
    if tma:
        w.lines("dy_s = tl.trans(dyd.load([seq0 + k0, h * P + pid_p * BP]))",
                "c_s = cd.load([seq0 + k0, g * N])")
    else:
        w.line("dy_s = tl.load(dy_ptr + ((bi64 * L + pos_s[None, :]) * H + h) * P + offs_p[:, None], "
               "mask=v_s[None, :] & m_p[:, None], other=0.0)")
        w.line("c_s = " + seq_tile("c_ptr", "bi64 * scb + g * scg", "pos_s", "scl", "offs_n", "v_s", "m_n"))
    w.line("dyw = " + to_io(r, "dy_s.to(tl.float32) * tl.exp(cs)[None, :]"))
    w.line("acc = " + dot(r, "dyw", "c_s", "acc"))


def render_state_pass(r: SSDRegion) -> str:
    """Kernel 2: states entering each chunk, in the io dtype; the final state in fp32."""
    q = r.chunk_size
    w = Writer()
    header(w, "ssd_state_pass", r, "Inter-chunk state passing, sequential over chunks.")
    args = ["states_ptr", "sin_ptr", "cs_ptr"] + (["init_ptr"] if r.has_initial_state else [])
    args += ["final_ptr", "SFB", "H", "NC", "PN", "BLK: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def ssd_state_pass({', '.join(args)}):"):
        w.lines("pid = tl.program_id(0)", "pid_bh = tl.program_id(1)",
                "bh64 = pid_bh.to(tl.int64)", "bi64 = bh64 // H", "h = pid_bh % H",
                "offs = pid * BLK + tl.arange(0, BLK)", "m = offs < PN")
        if r.has_initial_state:
            w.line("s = tl.load(init_ptr + bh64 * PN + offs, mask=m, other=0.0).to(tl.float32)")
        else:
            w.line("s = tl.zeros((BLK,), dtype=tl.float32)")
        with w.block("for c in range(0, NC):"):
            w.line("idx = ((bi64 * NC + c) * H + h) * PN")
            w.line(f"tl.store(sin_ptr + idx + offs, {to_io(r, 's')}, mask=m)")
            w.line(f"tot = tl.load(cs_ptr + (bh64 * NC + c) * {q} + {q - 1})")
            w.line("st = tl.load(states_ptr + idx + offs, mask=m, other=0.0)")
            w.line("s = s * tl.exp(tot) + st")
        w.comment("SFB: the final state's batch stride (a row of a wider buffer, as context parallelism's summary)")
        w.line("tl.store(final_ptr + bi64 * SFB + h * PN + offs, s, mask=m)")
    return w.source()


def chunk_cb_name(transposed: bool) -> str:
    return "ssd_chunk_cb_both" if transposed else "ssd_chunk_cb"


def render_chunk_cb(r: SSDRegion, transposed: bool = False) -> str:
    """Kernel 0: C_t.B_s inside each chunk, per group, (batch, chunk, group, q, q); with
    ``transposed`` also its transpose B_s.C_t (the backward's dx reads that one row by row)."""
    q = r.chunk_size
    name = chunk_cb_name(transposed)
    w = Writer()
    header(w, name, r, "C B^T inside each chunk, once per group (shared by its heads)"
           + (", and its transpose." if transposed else "."))
    args = ["b_ptr", "c_ptr", "cb_ptr"] + (["cbt_ptr"] if transposed else [])
    args += ["L", "G", "NC", "N", "sbb", "sbl", "sbg", "scb", "scl", "scg",
             "BM: tl.constexpr", "BK: tl.constexpr", "NP: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        w.lines(f"nk = {q} // BK + ({q} % BK > 0)", "pid_m = tl.program_id(0) // nk",
                "pid_k = tl.program_id(0) % nk", "pid_c = tl.program_id(1)", "pid_bg = tl.program_id(2)",
                "bi64 = (pid_bg // G).to(tl.int64)", "g = pid_bg % G",
                "offs_n = tl.arange(0, NP)", "m_n = offs_n < N")
        emit_positions(w, "t", "pid_m * BM", "BM", q)
        emit_positions(w, "s", "pid_k * BK", "BK", q)
        w.comment("tile pairs wholly above the diagonal hold zeros: readers then load whole tiles")
        w.comment("(unmasked along s, so vectorised) and the decay factor masks the rest")
        with w.block("if pid_k * BK < pid_m * BM + BM:"):
            w.line("c_t = " + seq_tile("c_ptr", "bi64 * scb + g * scg", "pos_t", "scl", "offs_n", "v_t", "m_n"))
            w.line("b_s = " + seq_tile("b_ptr", "bi64 * sbb + g * sbg", "pos_s", "sbl", "offs_n", "v_s", "m_n"))
            w.line(f"cb = {dot(r, 'c_t', 'tl.trans(b_s)')}")
        with w.block("else:"):
            w.line("cb = tl.zeros((BM, BK), dtype=tl.float32)")
        w.line(f"base = ((bi64 * NC + pid_c) * G + g) * {q * q}")
        w.line(f"tl.store(cb_ptr + base + t[:, None] * {q} + s[None, :], cb, "
               f"mask=(t < {q})[:, None] & (s < {q})[None, :])")
        if transposed:
            w.line(f"tl.store(cbt_ptr + base + s[None, :] * {q} + t[:, None], cb, "
                   f"mask=(t < {q})[:, None] & (s < {q})[None, :])")
    return w.source()


def cb_tile(q: int, rows: str, cols: str, inside: str) -> str:
    """Load text of a tile of this chunk's C B^T (``rows``/``cols`` index t and s; ``inside``
    masks positions past the chunk only, so the load stays vectorised)."""
    return f"tl.load(cb_ptr + cb_base + {rows} * {q} + {cols}, mask={inside}, other=0.0)"


def chunk_scan_name(mode: str, fold: bool = False) -> str:
    return ("ssd_chunk_scan" + ("_fold" if fold else "")) if mode == "forward" else "ssd_gate_backward"


def render_chunk_scan(r: SSDRegion, heads: int = 1, mode: str = "forward", tma: bool = False,
                      fold: bool = False) -> str:
    """Kernel 3 (forward output), or the backward's gate step (mode "gate_backward").

    ``fold`` (forward only; context parallelism): the states come from a zero start, and the
    incoming state's part enters as a second dot, ``C fs`` weighted by ``fw`` (``render_common``'s
    fold: the state read is S + fw fs), so the summed state is never formed in the loop; the first
    row tile of each (chunk, head) forms it once and stores it in ``so_ptr`` for the backward.

    ``tma``: the tiles of C, of the incoming states, of C B^T and of the partners' x come through
    tensor descriptors (``xd`` over x as (batch*seqlen, heads*headdim), ``cd`` over C as
    (batch*seqlen, groups*dstate), ``sd`` over the states as (batch*chunks*heads*headdim, dstate),
    ``cbd`` over C B^T as (batch*chunks*groups*chunk, chunk)), and the forward's y leaves through
    ``yd`` (y as (batch*seqlen, heads*headdim)); on Hopper these are TMA copies, with no
    per-element address arithmetic.  Only for EVEN launches (no tile runs past a chunk)."""
    if mode not in CHUNK_SCAN_MODES:
        raise ValueError(f"mode must be one of {CHUNK_SCAN_MODES}")
    if mode == "gate_backward" and not r.has_z:
        raise ValueError("the gate backward kernel exists only for regions with z")
    if fold and mode != "forward":
        raise ValueError("only the forward chunk scan takes a fold")
    name, q = chunk_scan_name(mode, fold), r.chunk_size
    w = Writer()
    header(w, name, r, f"Chunk output for {heads} head(s) per program"
           + (": y = C S_in + masked (C B^T) x, D skip, z gate." if mode == "forward"
              else ": recompute y, then dz and dy = dy_out * silu(z)."))
    args = ["x_ptr", "cb_ptr", "c_ptr"] + (["z_ptr"] if r.has_z else [])
    args += ["d_ptr"] if r.d_mode != "none" else []
    args += ["y_ptr"] if mode == "forward" else ["dyo_ptr", "dz_ptr", "dy_ptr"]
    args += ["dtp_ptr", "cs_ptr", "sin_ptr"] + (FOLD_ARGS + ["so_ptr"] if fold else [])
    args += ["C_LO", "L", "H", "HPG", "NC", "P", "N",
             "sxb", "sxl", "sxh", "scb", "scl", "scg"]
    args += ["szb", "szl", "szh"] if r.has_z else []
    args += ["xd", "cd", "sd", "cbd"] + (["yd"] if mode == "forward" else []) + (["fsd"] if fold else []) \
        if tma else []
    args += ["BM: tl.constexpr", "BK: tl.constexpr", "PP: tl.constexpr", "NP: tl.constexpr",
             "EVEN: tl.constexpr"]
    w.line('@triton.jit(do_not_specialize=["C_LO"])  # the segments of one forward share a binary')
    with w.block(f"def {name}({', '.join(args)}):"):
        w.comment("C_LO: the first chunk of this launch (a segment of the sequence's chunks)")
        w.lines("pid_m = tl.program_id(0)", "pid_c = tl.program_id(1) + C_LO", "pid_bh = tl.program_id(2)",
                f"bi = pid_bh // (H // {heads})", f"h0 = (pid_bh % (H // {heads})) * {heads}",
                "g = h0 // HPG", "bi64 = bi.to(tl.int64)")
        emit_dims(w, even=True)
        if tma:
            emit_descriptor_rows(w, q, "(H // HPG)")
        else:
            w.line(f"cb_base = ((bi64 * NC + pid_c) * (H // HPG) + g) * {q * q}")

        def state(j: int) -> str:
            if tma:
                tile = f"tl.trans(sd.load([((bi * NC + pid_c) * H + h0 + {j}) * P, 0]))"
            else:
                tile = state_tile("sin_ptr", f"(bi64 * NC + pid_c) * H + h0 + {j}", True)
            return tile

        def fold_term(j: int) -> str:
            term = fold_dot(r, w, "c_t", f"h0 + {j}", True, tma, f"_{j}")
            with w.block("if pid_m == 0:"):
                w.comment("the folded state, summed in fp32 and rounded once, for the backward")
                summed = to_io(r, f"st_{j}.to(tl.float32) + fw_{j} * fs_{j}.to(tl.float32)")
                w.line(f"tl.store(so_ptr + ((bi64 * NC + pid_c) * H + h0 + {j}) * P * N + offs_p[None, :] * N"
                       f" + offs_n[:, None], {summed}, mask=m_n[:, None] & m_p[None, :])")
            return term
        emit_scan_rows(w, r, heads, "pid_m * BM", mode, state, even=True, tma=tma,
                       fold=fold_term if fold else None)
    return w.source()


def emit_scan_rows(w: Writer, r: SSDRegion, heads: int, start: str, mode: str,
                   state: Callable[[int], str], even: bool = False, tma: bool = False,
                   fold: Optional[Callable[[int], str]] = None) -> None:
    """One row tile of the chunk scan (rows ``start`` .. ``start`` + BM) for ``heads`` heads of one
    group, through the epilogue; ``state(j)`` is the text of head j's incoming state as a
    (dstate x headdim) tile in the io dtype.  Needs ``cb_base`` (with ``tma``: ``seq0`` and
    ``cb_row``) and the dims' offsets; ``even``: the bounds masks take the kernel's EVEN constexpr
    (``render_common.emit_positions``); ``tma``: C, C B^T and x through the descriptors of
    ``render_chunk_scan``; ``fold(j)`` emits what follows head j's state tile ``st_j`` and gives
    the text of an fp32 term added to ``C st_j`` before the decay."""
    q = r.chunk_size
    emit_positions(w, "t", start, "BM", q, even)
    if tma:
        w.line(f"c_t = cd.load([seq0 + {start}, g * N])")
    else:
        w.line("c_t = " + seq_tile("c_ptr", "bi64 * scb + g * scg", "pos_t", "scl", "offs_n", "v_t", "m_n"))
    if r.d_mode != "none":
        w.comment("the rows' own x for the D skip, loaded now so that its latency hides behind the dots")
        for j in range(heads):
            w.line(f"x_t_{j} = " + seq_tile("x_ptr", f"bi64 * sxb + (h0 + {j}) * sxh", "pos_t", "sxl",
                                           "offs_p", "v_t", "m_p"))
    w.comment("tiles of partners s wholly before this row tile factor their decay through the")
    w.comment("last of them, r = off - 1:  exp(cs_t - cs_s) = exp(cs_t - cs_r) exp(cs_r - cs_s), both <= 1")
    w.line(f"off = ({start}) // BK * BK")
    w.comment("contribution of the state entering the chunk: exp(cs_t) = exp(cs_t - cs_r) exp(cs_r)")
    w.comment("(the partners' cumsum and dt vectors are loaded a step ahead, here for the first of each")
    w.comment("loop, so that no dot waits on a global load issued just before it)")
    for j in range(heads):
        w.line(f"row_{j} = (bi64 * H + h0 + {j}) * (NC * {q}) + pid_c * {q}")
    _load_partner_vectors(w, heads)
    for j in range(heads):
        w.line(f"cs_t_{j} = tl.load(cs_ptr + row_{j} + t, mask={inside('t', q, even)}, other=0.0)")
        w.line(f"cs_r_{j} = tl.load(cs_ptr + row_{j} + off - 1, mask=off > 0, other=0.0)")
        w.comment("BK == BM (constexpr): one diagonal tile, whose partners are the rows themselves")
        with w.block("if BK == BM:"):
            w.line(f"dt_d_{j} = tl.load(dtp_ptr + row_{j} + t, mask={inside('t', q, even)}, other=0.0)")
        w.line(f"st_{j} = {state(j)}")
        part = dot(r, 'c_t', f'st_{j}')
        if fold is not None:
            part = f"({part} + {fold(j)})"
        w.line(f"acc_{j} = {part} * tl.exp(cs_r_{j})")
    w.comment("causal intra-chunk part; C B^T (from ssd_chunk_cb) is shared by the heads")
    with w.block("for k0 in range(0, off, BK):"):
        chunk_scan_partners(w, r, heads, diagonal=False, even=even, tma=tma, start=start, given=("cs_nx", "dt_nx"))
        _load_partner_vectors(w, heads, "k0 + BK")
    for j in range(heads):
        w.line(f"acc_{j} = acc_{j} * tl.exp(cs_t_{j} - cs_r_{j})[:, None]")
    with w.block("if BK == BM:"):
        w.line(f"k0 = {start}")
        chunk_scan_partners(w, r, heads, diagonal=True, even=even, tma=tma, start=start, given=("cs_t", "dt_d"))
    with w.block("else:"):
        with w.block(f"for k0 in range(off, {start} + BM, BK):"):
            chunk_scan_partners(w, r, heads, diagonal=True, even=even, tma=tma, start=start)
    for j in range(heads):
        chunk_scan_epilogue(w, r, j, mode, tma_store=tma and mode == "forward", start=start)


def _load_partner_vectors(w: Writer, heads: int, first: str | None = None) -> None:
    """Each head's cumsum and dt of the partner tile starting at ``first`` (default 0) as
    ``cs_nx_j`` and ``dt_nx_j``, masked off past ``off``: what the next off-diagonal step reads."""
    w.line("s_nx = " + (f"{first} + " if first else "") + "tl.arange(0, BK)")
    for j in range(heads):
        w.line(f"cs_nx_{j} = tl.load(cs_ptr + row_{j} + s_nx, mask=s_nx < off, other=0.0)")
        w.line(f"dt_nx_{j} = tl.load(dtp_ptr + row_{j} + s_nx, mask=s_nx < off, other=0.0)")


def chunk_scan_partners(w: Writer, r: SSDRegion, heads: int, diagonal: bool, even: bool = False,
                        tma: bool = False, start: str = "", given: tuple[str, str] | None = None) -> None:
    """One partner tile s of the chunk scan: on the diagonal the full masked decay, before it
    only the partners' factor exp(cs_r - cs_s) (the rows' factor is applied once, after).
    ``given``: the names (before ``_j``) of the partners' cumsum and dt vectors, loaded already."""
    q = r.chunk_size
    emit_positions(w, "s", "k0", "BK", q, even)
    t_in, s_in = inside("t", q, even), inside("s", q, even)
    if diagonal:
        w.line("causal = (t[:, None] >= s[None, :]) & v_s[None, :]")
    if tma:
        w.line(f"cb = cbd.load([cb_row + {start}, k0])")
    else:
        w.line("cb = " + cb_tile(q, "t[:, None]", "s[None, :]", f"{t_in}[:, None] & {s_in}[None, :]"))
    for j in range(heads):
        if given:
            w.lines(f"cs_s = {given[0]}_{j}", f"dt_s = {given[1]}_{j}")
        else:
            w.line(f"cs_s = tl.load(cs_ptr + row_{j} + s, mask={s_in}, other=0.0)")
            w.line(f"dt_s = tl.load(dtp_ptr + row_{j} + s, mask={s_in}, other=0.0)")
        if diagonal:
            w.line(f"wj = cb * tl.exp(tl.where(causal, cs_t_{j}[:, None] - cs_s[None, :], {NEG}))"
                   " * dt_s[None, :]")
        else:
            w.line(f"wj = cb * (tl.exp(cs_r_{j} - cs_s) * dt_s)[None, :]")
        if tma:
            w.line(f"x_s = xd.load([seq0 + k0, (h0 + {j}) * P])")
        else:
            w.line("x_s = " + seq_tile("x_ptr", f"bi64 * sxb + (h0 + {j}) * sxh", "pos_s", "sxl",
                                       "offs_p", "v_s", "m_p"))
        w.line(f"acc_{j} = {dot(r, to_io(r, 'wj'), 'x_s', f'acc_{j}')}")


def chunk_scan_epilogue(w: Writer, r: SSDRegion, j: int, mode: str, tma_store: bool = False,
                        start: str = "") -> None:
    """D skip and z gate of head j (forward), or the gate's backward (gate_backward); x_t_j (the
    rows' x) was loaded at the start.  ``tma_store``: y leaves through the descriptor ``yd`` (y as
    (batch*seqlen, heads*headdim)), its rows from ``start``."""
    h = f"h0 + {j}"
    w.comment(f"epilogue of head {j}")
    w.line(f"y = acc_{j}")
    if r.d_mode != "none":
        w.line(f"x_t = x_t_{j}.to(tl.float32)")
        if r.d_mode == "head":
            w.line(f"y = y + x_t * tl.load(d_ptr + {h}).to(tl.float32)")
        else:
            w.line(f"y = y + x_t * tl.load(d_ptr + ({h}) * P + offs_p, mask=m_p, other=0.0)"
                   ".to(tl.float32)[None, :]")
    if r.has_z:
        w.line("zz = " + seq_tile("z_ptr", f"bi64 * szb + ({h}) * szh", "pos_t", "szl", "offs_p",
                                  "v_t", "m_p") + ".to(tl.float32)")
        w.line("sg = tl.sigmoid(zz)")
    if mode == "forward":
        if r.has_z:
            w.line("y = y * zz * sg")
        if tma_store:
            w.line(f"yd.store([seq0 + {start}, ({h}) * P], {to_io(r, 'y')})")
        else:
            w.line(dense_store("y_ptr", "pos_t", h, "v_t", to_io(r, "y")))
        return
    w.line("dyo = " + dense_tile("dyo_ptr", "pos_t", h, "v_t") + ".to(tl.float32)")
    w.line("dz = dyo * y * sg * (1.0 + zz * (1.0 - sg))")
    w.line("dyv = dyo * zz * sg")
    w.line(dense_store("dz_ptr", "pos_t", h, "v_t", to_io(r, "dz")))
    w.line(dense_store("dy_ptr", "pos_t", h, "v_t", to_io(r, "dyv")))
