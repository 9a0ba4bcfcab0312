"""Triton source of the Mamba-1 selective scan, forward and backward, for one region.

Layout the launcher (``selective_scan_kernels``) provides: u, delta, z, out and the gradient
buffers are dense (batch, dim, seqlen); B and C dense (batch, groups, dstate, seqlen); A (dim,
dstate); states (batch, dim, dstate) and per-chunk states (batch, nchunks, dim, dstate), fp32.
A program owns ``BD`` channels of one group of one batch element (grid axis 0 = groups * channel
blocks per group, axis 1 = batch, axis 2 = chunk for the per-chunk kernels) and keeps their
(BD, dstate) state in fp32 registers.

h_t = exp(delta'_t A) h_{t-1} + delta'_t u_t B_t,  out_t = (C_t . h_t + D u_t) silu(z_t).

The chunks run in parallel; only a short pass over chunk summaries is sequential:

* ``chunk_local``: each chunk's end state from a zero start, and the sum of delta' over it (the
  chunk's decay is exp(A * sum)).
* ``combine``: the state entering every chunk (the checkpoints) and the last state.
* ``chunk_out``: out, each chunk restarted from its checkpoint.
* backward ``adjoint_local``: each chunk's contribution to dLoss/d(state entering it) with a zero
  gradient at its end (the adjoint g_{t-1} = exp(delta'_t A) (g_t + gy_t C_t) needs no states);
  ``adjoint_combine``: the gradient at every chunk's end, and d(initial state);
  ``selective_scan_bwd``: per chunk, recompute the states from the checkpoint into scratch and
  run the adjoint through them: du, ddelta, dz per step, dB/dC per step (atomically added over
  the channel blocks of a group), dA/dD per chunk (the launcher sums these partials).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from mambac.codegen.render_scan_common import header, silu_gate, skip_gate_store
from mambac.codegen.scan_ir import SelectiveScanRegion
from mambac.codegen.writer import Writer

LOCAL = "selective_scan_chunk_local"
COMBINE = "selective_scan_combine"
OUT = "selective_scan_chunk_out"
ADJ_LOCAL = "selective_scan_adjoint_local"
ADJ_COMBINE = "selective_scan_adjoint_combine"
BWD = "selective_scan_bwd"


def _inputs(r: SelectiveScanRegion) -> list[str]:
    out = ["u_ptr", "delta_ptr", "A_ptr", "B_ptr", "C_ptr"]
    return out + [n for n, on in (("D_ptr", r.has_D), ("z_ptr", r.has_z), ("bias_ptr", r.has_delta_bias))
                  if on]


SIZES = ["L", "DIM", "N", "G", "DPG", "NDB", "NC"]
CONSTS = ["BD: tl.constexpr", "NP: tl.constexpr", "T: tl.constexpr"]


def _channels(w: Writer, chunk_axis: bool) -> None:
    """Program ids (``c``: the chunk, grid axis 2, when ``chunk_axis``), channel/state offsets, A."""
    w.lines("pid = tl.program_id(0)", "bi = tl.program_id(1).to(tl.int64)")
    if chunk_axis:
        w.line("c = tl.program_id(2)")
    w.lines("gi = pid // NDB", "offs_c = (pid % NDB) * BD + tl.arange(0, BD)", "m_c = offs_c < DPG",
            "ch = gi * DPG + offs_c", "offs_n = tl.arange(0, NP)", "m_n = offs_n < N",
            "m2 = m_c[:, None] & m_n[None, :]",
            "A = tl.load(A_ptr + ch[:, None] * N + offs_n[None, :], mask=m2, other=0.0).to(tl.float32)")


def _prologue(w: Writer, r: SelectiveScanRegion) -> None:
    """Program ids, channel/state offsets, per-channel constants of the per-chunk kernels."""
    _channels(w, chunk_axis=True)
    w.lines("row = (bi * DIM + ch) * L  # start of each channel's sequence in u, delta, z",
            "bc = (bi * G + gi) * N * L + offs_n * L  # start of each state row of B, C")
    if r.has_D:
        w.line("Dv = tl.load(D_ptr + ch, mask=m_c, other=0.0).to(tl.float32)")
    if r.has_delta_bias:
        w.line("bias = tl.load(bias_ptr + ch, mask=m_c, other=0.0).to(tl.float32)")


def _step_inputs(w: Writer, r: SelectiveScanRegion) -> None:
    """Loads of step t (``valid`` masks steps past the end) and the delta prologue."""
    w.lines("mv = m_c & (offs_c * 0 + t < L)", "mn = m_n & (offs_n * 0 + t < L)",
            "u = tl.load(u_ptr + row + t, mask=mv, other=0.0).to(tl.float32)",
            "dv = tl.load(delta_ptr + row + t, mask=mv, other=0.0).to(tl.float32)")
    if r.has_delta_bias:
        w.line("dv = dv + bias")
    if r.delta_softplus:
        w.line("dl = tl.where(mv, _softplus(dv), 0.0)")
    else:
        w.line("dl = tl.where(mv, dv, 0.0)")
    w.lines("Bt = tl.load(B_ptr + bc + t, mask=mn, other=0.0).to(tl.float32)",
            "Ct = tl.load(C_ptr + bc + t, mask=mn, other=0.0).to(tl.float32)",
            "dA = tl.exp(dl[:, None] * A)")


ST = "(bi * DIM + ch[:, None]) * N + offs_n[None, :]"        # a (batch, dim, dstate) state
CK = "((bi * NC + c) * DIM + ch[:, None]) * N + offs_n[None, :]"  # chunk c of a per-chunk state
CV = "(bi * NC + c) * DIM + ch"                              # chunk c of a per-chunk (batch, dim) value


def _kernel(w: Writer, r: SelectiveScanRegion, name: str, what: str, args: list[str],
            steps: bool = True) -> None:
    """Header and signature; ``steps``: the kernel runs the delta prologue (needs softplus)."""
    header(w, name, r, what, softplus=r.delta_softplus and steps)
    w.line("@triton.jit")
    w.line(f"def {name}({', '.join(args + SIZES + CONSTS)}):")


@contextlib.contextmanager
def _chunk_kernel(r: SelectiveScanRegion, name: str, what: str, args: list[str]) -> Iterator[Writer]:
    """A per-chunk kernel (grid axis 2 = chunk): header, signature and prologue; the body is written
    inside the block."""
    w = Writer()
    _kernel(w, r, name, what, args)
    with w.indented():
        _prologue(w, r)
        yield w


@contextlib.contextmanager
def _steps_in_order(w: Writer, r: SelectiveScanRegion) -> Iterator[None]:
    """The loop over the chunk's steps, first to last, with step t's inputs loaded."""
    with w.block("for i in range(0, T):"):
        w.line("t = c * T + i")
        _step_inputs(w, r)
        yield


def _gate_grad(w: Writer, r: SelectiveScanRegion, store_dz: bool) -> None:
    """gy = dLoss/d(pre-gate out) at step t (and dz when ``store_dz``; needs ``h``)."""
    w.line("go = tl.load(gout_ptr + row + t, mask=mv, other=0.0).to(tl.float32)")
    if not r.has_z:
        w.line("gy = go")
        return
    w.lines("zv = tl.load(z_ptr + row + t, mask=mv, other=0.0).to(tl.float32)")
    silu_gate(w, "zv", grad=store_dz)
    if store_dz:
        w.line("ypre = tl.sum(h * Ct[None, :], axis=1)" + (" + Dv * u" if r.has_D else ""))
        w.line("tl.store(dz_ptr + row + t, go * ypre * dsilu, mask=mv)")
    w.line("gy = go * silu")


def render_chunk_local(r: SelectiveScanRegion) -> str:
    with _chunk_kernel(r, LOCAL, "Per chunk: end state from a zero start and the sum of delta'.",
                       _inputs(r) + ["local_ptr", "sdl_ptr"]) as w:
        w.lines("h = tl.zeros((BD, NP), dtype=tl.float32)", "sdl = tl.zeros((BD,), dtype=tl.float32)")
        with _steps_in_order(w, r):
            w.lines("h = dA * h + (dl * u)[:, None] * Bt[None, :]", "sdl += dl")
        w.lines(f"tl.store(local_ptr + {CK}, h, mask=m2)", f"tl.store(sdl_ptr + {CV}, sdl, mask=m_c)")
    return w.source()


def _over_chunks(w: Writer, v: str, store_ptr: str, add_ptr: str, reverse: bool) -> None:
    """The sequential pass over chunk summaries (last chunk first when ``reverse``): store ``v`` for
    chunk c to ``store_ptr``, then carry it over the chunk (decay exp(A * sum delta')) and add the
    chunk's own part from ``add_ptr``."""
    with w.block("for cc in range(0, NC):" if reverse else "for c in range(0, NC):"):
        if reverse:
            w.line("c = NC - 1 - cc")
        w.lines(f"tl.store({store_ptr} + {CK}, {v}, mask=m2)", f"sdl = tl.load(sdl_ptr + {CV}, mask=m_c, other=0.0)",
                f"{v} = tl.exp(A * sdl[:, None]) * {v} + tl.load({add_ptr} + {CK}, mask=m2, other=0.0)")


def render_combine(r: SelectiveScanRegion) -> str:
    w = Writer()
    args = ["A_ptr"] + (["init_ptr"] if r.has_init else []) + ["local_ptr", "sdl_ptr", "ckpt_ptr", "last_ptr"]
    _kernel(w, r, COMBINE, "Sequential over chunk summaries: checkpoints and the last state.", args, False)
    with w.indented():
        _channels(w, chunk_axis=False)
        w.line("h = " + (f"tl.load(init_ptr + {ST}, mask=m2, other=0.0).to(tl.float32)" if r.has_init
                         else "tl.zeros((BD, NP), dtype=tl.float32)"))
        _over_chunks(w, "h", "ckpt_ptr", "local_ptr", reverse=False)
        w.line(f"tl.store(last_ptr + {ST}, h, mask=m2)")
    return w.source()


def render_chunk_out(r: SelectiveScanRegion) -> str:
    with _chunk_kernel(r, OUT, "Per chunk: out, restarted from the chunk's checkpoint.",
                       _inputs(r) + ["ckpt_ptr", "out_ptr"]) as w:
        w.line(f"h = tl.load(ckpt_ptr + {CK}, mask=m2, other=0.0)")
        with _steps_in_order(w, r):
            w.lines("h = dA * h + (dl * u)[:, None] * Bt[None, :]", "y = tl.sum(h * Ct[None, :], axis=1)")
            skip_gate_store(w, r, "u", "row + t", "mv", "out_ptr")
    return w.source()


def render_adjoint_local(r: SelectiveScanRegion) -> str:
    with _chunk_kernel(r, ADJ_LOCAL, "Per chunk: dLoss/d(state entering it) with a zero gradient at its end.",
                       _inputs(r) + ["gout_ptr", "gl_ptr"]) as w:
        w.line("g = tl.zeros((BD, NP), dtype=tl.float32)")
        with w.block("for ii in range(0, T):"):
            w.line("t = c * T + T - 1 - ii")
            _step_inputs(w, r)
            _gate_grad(w, r, store_dz=False)
            w.lines("g = (g + gy[:, None] * Ct[None, :]) * dA")
        w.line(f"tl.store(gl_ptr + {CK}, g, mask=m2)")
    return w.source()


def render_adjoint_combine(r: SelectiveScanRegion) -> str:
    w = Writer()
    args = ["A_ptr", "sdl_ptr", "gl_ptr", "glast_ptr", "gend_ptr"] + (["dinit_ptr"] if r.has_init else [])
    _kernel(w, r, ADJ_COMBINE, "Sequential over chunks, last first: the gradient at every chunk's end.", args,
            False)
    with w.indented():
        _channels(w, chunk_axis=False)
        w.line(f"g = tl.load(glast_ptr + {ST}, mask=m2, other=0.0)")
        _over_chunks(w, "g", "gend_ptr", "gl_ptr", reverse=True)
        if r.has_init:
            w.line(f"tl.store(dinit_ptr + {ST}, g, mask=m2)")
    return w.source()


def render_backward(r: SelectiveScanRegion) -> str:
    """Per chunk: recompute states into scratch, then the adjoint from the chunk's end gradient."""
    args = _inputs(r) + ["ckpt_ptr", "gend_ptr", "scratch_ptr", "gout_ptr", "du_ptr", "ddelta_ptr", "dA_ptr",
                         "dB_ptr", "dC_ptr"]
    args += [n for n, on in (("dD_ptr", r.has_D), ("dz_ptr", r.has_z)) if on] + ["C0"]
    with _chunk_kernel(r, BWD, "Per chunk: states recomputed from the checkpoint into scratch, then the adjoint "
                               "run backwards through them.", args) as w:
        w.lines("c = C0 + c  # the launcher runs the chunks in waves of num_programs(2) (bounded scratch)",
                f"h = tl.load(ckpt_ptr + {CK}, mask=m2, other=0.0)",
                f"g = tl.load(gend_ptr + {CK}, mask=m2, other=0.0)",
                "dA_acc = tl.zeros((BD, NP), dtype=tl.float32)",
                "scr = scratch_ptr + (((bi * tl.num_programs(2) + tl.program_id(2)) * DIM + ch[:, None]) * T) * N "
                "+ offs_n[None, :]",
                "bc_g = (bi * G + gi) * N * L + offs_n * L  # dB/dC rows of this group (fp32, accumulated)")
        if r.has_D:
            w.line("dD_acc = tl.zeros((BD,), dtype=tl.float32)")
        w.comment("recompute: scratch[i] = state before step i of this chunk")
        with _steps_in_order(w, r):
            w.line("tl.store(scr + i * N, h, mask=m2)")
            w.line("h = dA * h + (dl * u)[:, None] * Bt[None, :]")
        w.comment("adjoint, last step of the chunk first; g = dLoss/dh_t")
        with w.block("for ii in range(0, T):"):
            w.lines("i = T - 1 - ii", "t = c * T + i")
            _step_inputs(w, r)
            w.lines("hp = tl.load(scr + i * N, mask=m2, other=0.0)",
                    "h = dA * hp + (dl * u)[:, None] * Bt[None, :]")
            _gate_grad(w, r, store_dz=True)
            if r.has_D:
                w.lines("dD_acc += gy * u", "du = gy * Dv")
            else:
                w.line("du = tl.zeros((BD,), dtype=tl.float32)")
            w.line("tl.atomic_add(dC_ptr + bc_g + t, tl.sum(gy[:, None] * h, axis=0), mask=mn)")
            w.line("g = g + gy[:, None] * Ct[None, :]")
            w.lines("gB = tl.sum(g * Bt[None, :], axis=1)", "ddl = gB * u", "du += gB * dl",
                    "tl.atomic_add(dB_ptr + bc_g + t, tl.sum(g * (dl * u)[:, None], axis=0), mask=mn)",
                    "gdec = g * hp * dA", "ddl += tl.sum(gdec * A, axis=1)",
                    "dA_acc += gdec * dl[:, None]", "g = g * dA")
            if r.delta_softplus:
                w.line("ddl = ddl * tl.sigmoid(dv)")
            w.lines("tl.store(du_ptr + row + t, du, mask=mv)", "tl.store(ddelta_ptr + row + t, ddl, mask=mv)")
        w.line(f"tl.store(dA_ptr + {CK}, dA_acc, mask=m2)")
        if r.has_D:
            w.line(f"tl.store(dD_ptr + {CV}, dD_acc, mask=m_c)")
    return w.source()
