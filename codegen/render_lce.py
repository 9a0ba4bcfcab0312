"""Renderers of the softmax kernels of the fused linear cross-entropy (``mambac.ops.linear_cross_entropy``).

Both work on one chunk of logits z, a (rows, V) matrix whose row stride is a runtime argument
and whose vocab dim is dense.  A program handles ``BM`` rows and walks the vocab in ``BV`` tiles,
in fp32 whatever the logits' dtype:

    lce_stats:  lse = m + log(sum exp(z - m)) with a running max m (one read of z),
                loss = lse - z[label] (0 where label == ignore_index)
    lce_grad:   z <- (exp(z - lse) - onehot(label)) * scale   (0 where label == ignore_index),
                written over z itself (one read, one write)

A label outside [0, V) other than ``ignore_index`` is never read: its row's loss term and
gradient are nan, so a bad label shows in the loss instead of reading out of bounds.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from mambac.codegen.render_common import NEG, emit_to_bf16, file_header, scaled
from mambac.codegen.writer import Writer

if TYPE_CHECKING:
    from mambac.codegen.lce_kernels import LceRegion

STATS, GRAD = "lce_stats", "lce_grad"


@contextlib.contextmanager
def _row_kernel(name: str, r: LceRegion, what: str, args: list[str]) -> Iterator[Writer]:
    """Header, signature and the row setup every program shares: its rows, their offsets into z,
    their labels and whether each counts (``valid``) and lies in the vocab (``inside``)."""
    w = Writer()
    file_header(w, name, r.summary(), what)
    if _rounds(r):
        emit_to_bf16(w, note_as_docstring=True)
    args = args + ["M", "V", "szm", "ignore_index", "BM: tl.constexpr", "BV: tl.constexpr"]
    w.line("@triton.jit")
    with w.block(f"def {name}({', '.join(args)}):"):
        w.lines("pid_m = tl.program_id(0)", "rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)",
                "m_r = rows < M", f"ro = {scaled('rows', 'szm', r.hints)}", "offs = tl.arange(0, BV)",
                "lab = tl.load(lab_ptr + rows, mask=m_r, other=ignore_index)", "valid = lab != ignore_index",
                "inside = (lab >= 0) & (lab < V)")
        yield w


def _rounds(r: LceRegion) -> bool:
    return r.round_bf16 and r.io_dtype == "bf16"


def _vocab_tile(w: Writer, other: str) -> None:
    """Inside the vocab loop: ``cols``, ``mask``, ``ptrs`` and the fp32 tile ``x`` of z."""
    w.lines("cols = v0 + offs", "mask = m_r[:, None] & (cols < V)[None, :]",
            "ptrs = z_ptr + ro[:, None] + cols[None, :]",
            f"x = tl.load(ptrs, mask=mask, other={other}).to(tl.float32)")


def render_stats(r: LceRegion) -> str:
    """``lce_stats``: per-row log-sum-exp and loss term (fp32 outputs of length M)."""
    with _row_kernel(STATS, r, "Per-row log-sum-exp and cross-entropy term of a chunk of logits, one pass.",
                     ["z_ptr", "lab_ptr", "lse_ptr", "loss_ptr"]) as w:
        w.comment(f"running max (from {NEG}, so a fully masked tile gives exp(-inf) = 0, never nan) and sum")
        w.line(f"run_max = tl.zeros((BM,), dtype=tl.float32) + {NEG}")
        w.line("run_sum = tl.zeros((BM,), dtype=tl.float32)")
        with w.block("for v0 in range(0, V, BV):"):
            _vocab_tile(w, 'float("-inf")')
            w.line("new_max = tl.maximum(run_max, tl.max(x, 1))")
            w.line("run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), 1)")
            w.line("run_max = new_max")
        w.comment("a row's sum is at least 1 (its max term); rows past M have none and take log(1)")
        w.line("lse = run_max + tl.log(tl.where(m_r, run_sum, 1.0))")
        w.line("target = tl.load(z_ptr + ro + lab, mask=m_r & valid & inside, other=0.0).to(tl.float32)")
        w.line('loss = tl.where(valid, tl.where(inside, lse - target, float("nan")), 0.0)')
        w.line("tl.store(lse_ptr + rows, lse, mask=m_r)")
        w.line("tl.store(loss_ptr + rows, loss, mask=m_r)")
    return w.source()


def render_grad(r: LceRegion) -> str:
    """``lce_grad``: the logits' gradient, stored over the logits in their own dtype."""
    with _row_kernel(GRAD, r, "Cross-entropy gradient (softmax - onehot) * scale, in place over a chunk of logits.",
                     ["z_ptr", "lse_ptr", "lab_ptr", "scale_ptr"]) as w:
        w.line("lse = tl.load(lse_ptr + rows, mask=m_r, other=0.0)")
        w.line('coef = tl.where(inside, tl.load(scale_ptr).to(tl.float32), float("nan"))')
        with w.block("for v0 in range(0, V, BV):"):
            _vocab_tile(w, "0.0")
            w.line("hit = cols[None, :] == lab[:, None]")
            w.line("g = (tl.exp(x - lse[:, None]) - tl.where(hit, 1.0, 0.0)) * coef[:, None]")
            w.comment("ignored rows give 0 (a where, not a product: nothing of theirs can turn it into nan)")
            w.line("g = tl.where(valid[:, None], g, 0.0)")
            store = "_to_bf16(g)" if _rounds(r) else "g.to(z_ptr.dtype.element_ty)"
            w.line(f"tl.store(ptrs, {store}, mask=mask)")
    return w.source()
