"""Renderers of the causal conv1d kernels (forward and backward), specialised to a ``ConvRegion``.

Conventions: x (batch, dim, seqlen) and dy are read through (batch, dim, seq) strides; weight is
dense (dim, width); initial_state through its strides; y and dx are written through their strides
(laid out as x is: ``ops.causal_conv1d.output_like``), final_state and d initial_state are dense.  The taps are unrolled (``width`` is in the region), so the source reads like the formula.
Let ``full = cat(initial_state, x)`` along time (``initial_state`` is zero when absent):

    y_t   = act(bias + sum_k w_k full_{t+k})            forward, one tile of (channels x steps)
    final = full[L : L+width-1]                          written by the first step tile
    dfull_m = sum_k w_k g_{m-k} + dfinal_{m-L}           backward, g = dy * act'(u), u recomputed
    dx_t = dfull_{t+width-1},  dinit_i = dfull_i,  dw_k = sum_t g_t full_{t+k},  dbias = sum_t g_t

The backward stores per-tile partial sums of dw and dbias (fp32); the launcher adds them up.
"""
from __future__ import annotations

from mambac.codegen.conv_norm_ir import ConvRegion
from mambac.codegen.kernel_ir import pow2
from mambac.codegen.render_common import file_header, scaled
from mambac.codegen.writer import Writer

FWD_NAME = "causal_conv1d_fwd"
BWD_NAME = "causal_conv1d_bwd"


def _emit_tile_setup(w: Writer, r: ConvRegion) -> None:
    w.lines("pid_l = tl.program_id(0)", "pid_d = tl.program_id(1)", "bi64 = tl.program_id(2).to(tl.int64)",
            "offs_d = pid_d * BD + tl.arange(0, BD)", "m_d = offs_d < D",
            f"xb = x_ptr + bi64 * sxb + {scaled('offs_d', 'sxd', r.hints)}")


def _full_load(r: ConvRegion, f: str) -> str:
    """Load text of ``full`` at full-time index expression ``f`` (a (BL,) vector) as fp32."""
    wm1 = r.width - 1
    text = (f"tl.load(xb[:, None] + {scaled(f'{f} - {wm1}', 'sxl', r.hints)}[None, :], "
            f"mask=m_d[:, None] & ({f} >= {wm1})[None, :] & ({f} < L + {wm1})[None, :], other=0.0)"
            ".to(tl.float32)")
    if r.has_initial_state and wm1 > 0:
        text += (f" + tl.load(ib[:, None] + {scaled(f, 'sil', r.hints)}[None, :], mask=m_d[:, None] & ({f} >= 0)[None, :]"
                 f" & ({f} < {wm1})[None, :], other=0.0).to(tl.float32)")
    return text


def _args(r: ConvRegion, backward: bool) -> list[str]:
    args = ["x_ptr", "w_ptr"] + (["bias_ptr"] if r.has_bias else [])
    args += ["init_ptr"] if r.has_initial_state else []
    if backward:
        args += ["dy_ptr"] + (["dfinal_ptr"] if r.has_dfinal else []) + ["dx_ptr"]
        args += (["dinit_ptr"] if r.has_initial_state else []) + ["dw_ptr"]
        args += (["db_ptr"] if r.has_bias else []) + ["L", "D", "NT", "sxb", "sxd", "sxl"]
        args += ["sib", "sid", "sil"] if r.has_initial_state else []
        args += ["sgb", "sgd", "sgl", "sob", "sod", "sol"]
    else:
        args += ["y_ptr", "final_ptr", "L", "D", "sxb", "sxd", "sxl"]
        args += ["sib", "sid", "sil"] if r.has_initial_state else []
        args += ["sob", "sod", "sol"]
    return args + ["BD: tl.constexpr", "BL: tl.constexpr"]


def _emit_weights(w: Writer, r: ConvRegion) -> None:
    for k in range(r.width):
        w.line(f"w_{k} = tl.load(w_ptr + offs_d * {r.width} + {k}, mask=m_d, other=0.0).to(tl.float32)")
    if r.has_initial_state:
        w.line(f"ib = init_ptr + bi64 * sib + {scaled('offs_d', 'sid', r.hints)}")


def render_forward(r: ConvRegion) -> str:
    wm1 = r.width - 1
    w = Writer()
    file_header(w, FWD_NAME, r.summary(), "Causal depthwise conv1d: taps unrolled, bias, SiLU, final state.")
    w.line("@triton.jit")
    with w.block(f"def {FWD_NAME}({', '.join(_args(r, False))}):"):
        _emit_tile_setup(w, r)
        _emit_weights(w, r)
        w.line("offs_t = pid_l * BL + tl.arange(0, BL)")
        w.line("m_t = offs_t < L")
        init = "tl.load(bias_ptr + offs_d, mask=m_d, other=0.0).to(tl.float32)[:, None]" if r.has_bias else "0.0"
        w.line(f"acc = tl.zeros((BD, BL), dtype=tl.float32) + {init}")
        w.comment("y_t = sum_k w_k full_{t+k}; full index t+k is x position t+k-(width-1)")
        for k in range(r.width):
            w.line(f"acc += w_{k}[:, None] * ({_full_load(r, f'offs_t + {k}')})")
        if r.silu:
            w.line("acc = acc * tl.sigmoid(acc)")
        w.line(f"tl.store(y_ptr + bi64 * sob + {scaled('offs_d', 'sod', r.hints)}[:, None] + "
               f"{scaled('offs_t', 'sol', r.hints)}[None, :], "
               "acc.to(y_ptr.dtype.element_ty), mask=m_d[:, None] & m_t[None, :])")
        if wm1 > 0:
            w.comment("final state: the last width-1 entries of full, from the first step tile")
            with w.block("if pid_l == 0:"):
                w.line(f"offs_j = tl.arange(0, {pow2(wm1)})")
                w.line(f"fin = {_full_load(r, 'L + offs_j')}")
                w.line(f"tl.store(final_ptr + (bi64 * D + offs_d[:, None]) * {wm1} + offs_j[None, :], "
                       f"fin.to(final_ptr.dtype.element_ty), mask=m_d[:, None] & (offs_j < {wm1})[None, :])")
    return w.source()


def render_backward(r: ConvRegion) -> str:
    wm1, width = r.width - 1, r.width
    w = Writer()
    file_header(w, BWD_NAME, r.summary(),
                "Causal conv1d backward: d(full) by a transposed conv of g = dy * act'(u), dw/dbias partials.")
    w.line("@triton.jit")
    with w.block(f"def {BWD_NAME}({', '.join(_args(r, True))}):"):
        _emit_tile_setup(w, r)
        _emit_weights(w, r)
        w.line(f"gb = dy_ptr + bi64 * sgb + {scaled('offs_d', 'sgd', r.hints)}")
        w.line("offs_m = pid_l * BL + tl.arange(0, BL)  # index into full = cat(init, x)")
        w.comment(f"full at offsets -{wm1}..+{wm1} from m (f_j is full_(m + j - {wm1}))")
        for j in range(2 * wm1 + 1):
            w.line(f"f_{j} = {_full_load(r, f'offs_m + {j - wm1}')}")
        bias = " + tl.load(bias_ptr + offs_d, mask=m_d, other=0.0).to(tl.float32)[:, None]" if r.has_bias else ""
        for k in range(width):
            w.comment(f"g at step m - {k}" + (" (pre-activation recomputed)" if r.silu else ""))
            w.line(f"q = offs_m - {k}")
            w.line(f"g_{k} = tl.load(gb[:, None] + {scaled('q', 'sgl', r.hints)}[None, :], mask=m_d[:, None] & (q >= 0)[None, :] "
                   "& (q < L)[None, :], other=0.0).to(tl.float32)")
            if r.silu:
                terms = " + ".join(f"w_{kk}[:, None] * f_{kk - k + wm1}" for kk in range(width))
                w.line(f"u = {terms}{bias}")
                w.line("sg = tl.sigmoid(u)")
                w.line(f"g_{k} = g_{k} * sg * (1.0 + u * (1.0 - sg))")
        w.line("dfull = " + " + ".join(f"w_{k}[:, None] * g_{k}" for k in range(width)))
        if r.has_dfinal and wm1 > 0:
            w.line("j = offs_m - L")
            w.line(f"dfull += tl.load(dfinal_ptr + (bi64 * D + offs_d[:, None]) * {wm1} + j[None, :], "
                   f"mask=m_d[:, None] & (j >= 0)[None, :] & (j < {wm1})[None, :], other=0.0).to(tl.float32)")
        w.line(f"pos = offs_m - {wm1}")
        w.line(f"tl.store(dx_ptr + bi64 * sob + {scaled('offs_d', 'sod', r.hints)}[:, None] + "
               f"{scaled('pos', 'sol', r.hints)}[None, :], "
               "dfull.to(dx_ptr.dtype.element_ty), mask=m_d[:, None] & (pos >= 0)[None, :] & (pos < L)[None, :])")
        if r.has_initial_state and wm1 > 0:
            w.line(f"tl.store(dinit_ptr + (bi64 * D + offs_d[:, None]) * {wm1} + offs_m[None, :], "
                   f"dfull.to(dinit_ptr.dtype.element_ty), mask=m_d[:, None] & (offs_m < {wm1})[None, :])")
        w.comment("partial sums over this tile: dw_k = sum_t g_t full_{t+k}, dbias = sum_t g_t")
        w.line("part = (bi64 * NT + pid_l) * D + offs_d")
        for k in range(width):
            w.line(f"tl.store(dw_ptr + part * {width} + {k}, tl.sum(g_0 * f_{k + wm1}, 1), mask=m_d)")
        if r.has_bias:
            w.line("tl.store(db_ptr + part, tl.sum(g_0, 1), mask=m_d)")
    return w.source()
