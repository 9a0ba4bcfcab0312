"""Pieces shared by the scan renderers (selective scan, Mamba-3): file header, jitted helpers,
store casts."""
from __future__ import annotations

from mambac.codegen.render_common import emit_softplus, emit_to_bf16, file_header
from mambac.codegen.scan_ir import Mamba3Region, ScanRegion, SelectiveScanRegion
from mambac.codegen.writer import Writer


def header(w: Writer, kernel: str, region: ScanRegion, what: str, *, softplus: bool = False,
           tanh: bool = False) -> None:
    """Module docstring, imports and the helpers the kernel uses."""
    file_header(w, kernel, region.summary(), what)
    if softplus:
        emit_softplus(w)
    if tanh:
        w.line("@triton.jit")
        with w.block("def _tanh(v):"):
            w.comment("saturates cleanly: exp overflow gives 1, underflow -1")
            w.line("return 1.0 - 2.0 / (tl.exp(2.0 * v) + 1.0)")
        w.lines("", "")
    if region.round_bf16 and region.io_dtype == "bf16":
        emit_to_bf16(w, note_as_docstring=False)


def to_out(region: ScanRegion, ptr: str, expr: str) -> str:
    """Text casting fp32 ``expr`` to the element type of ``ptr`` (an io-dtype output)."""
    if region.round_bf16 and region.io_dtype == "bf16":
        return f"_to_bf16({expr})"
    return f"({expr}).to({ptr}.dtype.element_ty)"


def silu_gate(w: Writer, zval: str, grad: bool) -> None:
    """``sig`` and ``silu`` of ``zval`` (and ``dsilu`` when ``grad``)."""
    w.line(f"sig = tl.sigmoid({zval})")
    w.line(f"silu = {zval} * sig")
    if grad:
        w.line(f"dsilu = sig * (1.0 + {zval} * (1.0 - sig))")


def skip_gate_store(w: Writer, r: SelectiveScanRegion | Mamba3Region, x: str, off: str, mask: str,
                    out_ptr: str) -> None:
    """Finish the output ``y`` of a step: add the D skip (``Dv * x``) and apply the z gate where the
    region has them (z read at ``off`` like the output), then store it at ``out_ptr + off``."""
    if r.has_D:
        w.line(f"y = y + Dv * {x}")
    if r.has_z:
        w.line(f"zv = tl.load(z_ptr + {off}, mask={mask}, other=0.0).to(tl.float32)")
        silu_gate(w, "zv", grad=False)
        w.line("y = y * silu")
    w.line(f"tl.store({out_ptr} + {off}, {to_out(r, out_ptr, 'y')}, mask={mask})")
