"""Renderers of the RMSNorm kernels: gated (grouped) RMSNorm and residual-add + RMSNorm.

Both work on rows of a (rows, features) view: the input's row stride is a runtime argument, the
feature dim is dense, outputs are dense.  A program handles ``BM`` rows and, for the gated norm,
one group of features (``GP`` is the group padded to a power of two).  With n = h * rstd(h):

    forward:   out = n * w  (gated: h = x * silu(z) before the norm, or out *= silu(z) after it)
    backward:  dh = rstd * (dn - n * mean(dn * n)),  dn = dout_eff * w,  dw = sum_rows dout_eff * n

The backward recomputes the statistics from the inputs and writes per-program partial sums of dw
(fp32); the launcher adds them up.
"""
from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Callable, Iterator

from mambac.codegen.conv_norm_ir import AddNormRegion, GatedNormRegion
from mambac.codegen.render_common import file_header, scaled
from mambac.codegen.writer import Writer

GATED_FWD, GATED_BWD = "gated_rmsnorm_fwd", "gated_rmsnorm_bwd"
ADD_FWD, ADD_BWD = "add_rmsnorm_fwd", "add_rmsnorm_bwd"


def _rows_setup(w: Writer, cols: str, ncols: str, width: str) -> None:
    w.lines("pid_m = tl.program_id(0)", "rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)",
            "m_r = rows < M", f"offs = tl.arange(0, {width})", f"cols = {cols}",
            f"mask = m_r[:, None] & (offs < {ncols})[None, :]")


@contextlib.contextmanager
def _norm_kernel(name: str, summary: str, what: str, args: list[str], cols: str, ncols: str, width: int,
                 stats: Callable[[Writer], None], hints=()) -> Iterator[Writer]:
    """Header, signature, row setup and ``stats`` (the loads and the norm) of a kernel over rows of
    ``ncols`` features (``cols``: their offsets, ``width``: the tile); its rest is written inside."""
    w = Writer()
    file_header(w, name, summary, what)
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        _rows_setup(w, cols, ncols, str(width))
        for stride in [a for a in args if a in _ROW_STRIDES]:
            w.line(f"ro_{stride} = {scaled('rows', stride, hints)}")
        stats(w)
        yield w


def _emit_norm_grads(w: Writer, ncols: str) -> None:
    """dw partial sums and dh from ``g`` (the gradient of the normed output before the weight)."""
    w.line(f"tl.store(dw_ptr + pid_m * N + cols, tl.sum(g * n, 0), mask=offs < {ncols})")
    w.line("dn = g * wv[None, :]")
    w.line(f"dh = rstd[:, None] * (dn - n * (tl.sum(dn * n, 1) / {ncols})[:, None])")


# row strides of the inputs (and N, the outputs' dense row stride): each row offset vector is
# formed once, ro_<stride> = rows * stride, with the region's alignment hint
_ROW_STRIDES = ("N", "sxm", "szm", "sgm", "srm", "sdm")


def _load(ptr: str, stride: str) -> str:
    return f"tl.load({ptr} + ro_{stride}[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)"


def _store(ptr: str, value: str) -> str:
    return (f"tl.store({ptr} + ro_N[:, None] + cols[None, :], ({value}).to({ptr}.dtype.element_ty), "
            "mask=mask)")


def _emit_gated_stats(w: Writer, r: GatedNormRegion) -> None:
    w.line("xv = " + _load("x_ptr", "sxm"))
    w.line("wv = tl.load(w_ptr + cols, mask=offs < G, other=0.0).to(tl.float32)")
    if r.has_z:
        w.line("zz = " + _load("z_ptr", "szm"))
        w.line("sg = tl.sigmoid(zz)")
        w.line("sz = zz * sg")
    w.line("h = xv * sz" if r.has_z and not r.norm_before_gate else "h = xv")
    w.line("rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / G + eps)")
    w.line("n = h * rstd[:, None]")


def _gated_args(r: GatedNormRegion, backward: bool) -> list[str]:
    args = ["x_ptr", "w_ptr"] + (["z_ptr"] if r.has_z else [])
    if backward:
        args += ["dy_ptr", "dx_ptr"] + (["dz_ptr"] if r.has_z else []) + ["dw_ptr"]
    else:
        args += ["y_ptr"]
    args += ["M", "N", "G", "eps", "sxm"] + (["szm"] if r.has_z else []) + (["sgm"] if backward else [])
    return args + ["BM: tl.constexpr"]


def _gated_kernel(r: GatedNormRegion, backward: bool) -> AbstractContextManager[Writer]:
    name, what = ((GATED_BWD, "Backward of the grouped, gated RMSNorm (statistics recomputed).") if backward else
                  (GATED_FWD, "Grouped RMSNorm with an optional SiLU gate, one group per program."))
    return _norm_kernel(name, r.summary(), what, _gated_args(r, backward), "tl.program_id(1) * G + offs", "G",
                        r.group_pow2, lambda w: _emit_gated_stats(w, r), r.hints)


def render_gated_forward(r: GatedNormRegion) -> str:
    with _gated_kernel(r, backward=False) as w:
        w.line("out = n * wv[None, :]" + (" * sz" if r.has_z and r.norm_before_gate else ""))
        w.line(_store("y_ptr", "out"))
    return w.source()


def render_gated_backward(r: GatedNormRegion) -> str:
    with _gated_kernel(r, backward=True) as w:
        w.line("g = " + _load("dy_ptr", "sgm"))
        if r.has_z:
            w.line("dsilu = sg * (1.0 + zz * (1.0 - sg))")
        if r.has_z and r.norm_before_gate:
            w.comment("gate after the norm: out = n * w * silu(z)")
            w.line(_store("dz_ptr", "g * n * wv[None, :] * dsilu"))
            w.line("g = g * sz")
        _emit_norm_grads(w, "G")
        if r.has_z and not r.norm_before_gate:
            w.comment("gate before the norm: h = x * silu(z)")
            w.line(_store("dz_ptr", "dh * xv * dsilu"))
            w.line("dh = dh * sz")
        w.line(_store("dx_ptr", "dh"))
    return w.source()


def _add_args(r: AddNormRegion, backward: bool) -> list[str]:
    args = ["x_ptr"] + (["res_ptr"] if r.has_residual else []) + ["w_ptr"]
    if backward:
        args += (["dout_ptr"] if r.has_dout else []) + (["dres_ptr"] if r.has_dres else [])
        args += ["dx_ptr"] + (["dresid_ptr"] if r.has_residual else []) + ["dw_ptr"]
    else:
        args += ["out_ptr", "resout_ptr"]
    args += ["M", "N", "eps", "sxm"] + (["srm"] if r.has_residual else [])
    if backward:
        args += (["sgm"] if r.has_dout else []) + (["sdm"] if r.has_dres else [])
    return args + ["BM: tl.constexpr"]


def _emit_add_stats(w: Writer, r: AddNormRegion) -> None:
    w.line("h = " + _load("x_ptr", "sxm") + (" + " + _load("res_ptr", "srm") if r.has_residual else ""))
    w.line("wv = tl.load(w_ptr + cols, mask=offs < N, other=0.0).to(tl.float32)")
    w.line("rstd = 1.0 / tl.sqrt(tl.sum(h * h, 1) / N + eps)")
    w.line("n = h * rstd[:, None]")


def _add_kernel(r: AddNormRegion, backward: bool) -> AbstractContextManager[Writer]:
    name, what = ((ADD_BWD, "Backward of residual add + RMSNorm (statistics recomputed).") if backward else
                  (ADD_FWD, "Residual add then RMSNorm: (rmsnorm(x + residual) * w, x + residual)."))
    return _norm_kernel(name, r.summary(), what, _add_args(r, backward), "offs", "N", r.width_pow2,
                        lambda w: _emit_add_stats(w, r), r.hints)


def render_add_forward(r: AddNormRegion) -> str:
    with _add_kernel(r, backward=False) as w:
        w.line(_store("resout_ptr", "h"))
        w.line(_store("out_ptr", "n * wv[None, :]"))
    return w.source()


def render_add_backward(r: AddNormRegion) -> str:
    with _add_kernel(r, backward=True) as w:
        if r.has_dout:
            w.line("g = " + _load("dout_ptr", "sgm"))
            _emit_norm_grads(w, "N")
        else:
            w.line("dh = tl.zeros((BM, %d), dtype=tl.float32)" % r.width_pow2)
        if r.has_dres:
            w.comment("the residual stream's own gradient passes straight through the add")
            w.line("dh = dh + " + _load("dres_ptr", "sdm"))
        w.line(_store("dx_ptr", "dh"))
        if r.has_residual:
            w.line(_store("dresid_ptr", "dh"))
    return w.source()
