"""Generated softmax kernels of the fused linear cross-entropy under the Triton interpreter:
``lce_stats`` and ``lce_grad_`` against a float64 referee at small awkward shapes (vocab not a
multiple of the tile, ignored labels, a strided chunk), and ``linear_cross_entropy`` in kernel mode
'triton' against mode 'reference' end to end.

Half-precision cases give the kernels logits already rounded to bf16 and the referee the same
values in float64.  Tolerances (relative, in norm): fp32 1e-5, bf16 1e-2.
"""
from __future__ import annotations

import math

import pytest
import torch

from mambac.codegen import lce_kernels, render_lce
from mambac.codegen.lce_kernels import LceRegion
from mambac.ops import linear_cross_entropy, use_kernels
from tests.helpers import assert_in_order, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
IGNORE = -100


def _labels(n: int, v: int, gen: torch.Generator, ignore_every: int = 4) -> torch.Tensor:
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[1::ignore_every] = IGNORE
    return labels


def _referee(z: torch.Tensor, labels: torch.Tensor, scale: float):
    """float64 (lse, loss terms, gradient) of the chunk ``z``."""
    z64 = z.double()
    lse = torch.logsumexp(z64, 1)
    valid = labels != IGNORE
    target = z64.gather(1, torch.where(valid, labels, 0)[:, None])[:, 0]
    grad = torch.softmax(z64, 1)
    grad[valid, labels[valid]] -= 1.0
    grad = torch.where(valid[:, None], grad * scale, 0.0)
    return lse, torch.where(valid, lse - target, 0.0), grad


def _check(name, got, want, dtype):
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]}"


@pytest.mark.interp
@pytest.mark.parametrize("n,v,dtype,pad", [
    (37, 1000, torch.float32, 0),     # vocab not a multiple of the 256-wide tile, rows not of the 4-row block
    (37, 1000, torch.bfloat16, 0),
    (9, 300, torch.float32, 12),      # a chunk whose rows are strided (row stride 312, a multiple of 8)
    (9, 300, torch.bfloat16, 5),      # odd row stride
])
def test_kernels_match_float64(n, v, dtype, pad):
    gen = torch.Generator().manual_seed(v + pad)
    wide = (torch.randn(n, v + pad, generator=gen) * 4).to(dtype)
    z = wide[:, :v]
    labels = _labels(n, v, gen)
    lse_r, loss_r, grad_r = _referee(z, labels, 0.37)
    lse, loss = lce_kernels.lce_stats(z, labels, IGNORE)
    assert lse.dtype == loss.dtype == torch.float32 and lse.shape == loss.shape == (n,)
    _check("lse", lse, lse_r, torch.float32)   # fp32 statistics of the (rounded) logits
    _check("loss", loss, loss_r, torch.float32)
    assert (loss[labels == IGNORE] == 0).all()
    buf = wide.clone()
    out = lce_kernels.lce_grad_(buf[:, :v], lse, labels, IGNORE, torch.tensor(0.37))
    assert out.data_ptr() == buf.data_ptr() and out.dtype == dtype   # in place, in the logits' dtype
    _check("grad", out, grad_r, dtype)
    assert (out[labels == IGNORE] == 0).all()
    assert torch.equal(buf[:, v:], wide[:, v:])   # the row padding beyond the vocab is untouched


@pytest.mark.interp
def test_label_outside_the_vocab_gives_nan_not_a_stray_read():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(6, 40, generator=gen)
    labels = torch.tensor([3, 40, IGNORE, -1, 0, 39])
    lse, loss = lce_kernels.lce_stats(z, labels, IGNORE)
    assert torch.isnan(loss[[1, 3]]).all() and torch.isfinite(loss[[0, 2, 4, 5]]).all()
    assert rel_err(lse, torch.logsumexp(z.double(), 1)) < 1e-6
    g = lce_kernels.lce_grad_(z.clone(), lse, labels, IGNORE, 1.0)
    assert torch.isnan(g[[1, 3]]).all() and torch.isfinite(g[[0, 2, 4, 5]]).all()


def _run(mode: str, h, w, labels, chunk: int, autocast: bool = False):
    """(loss, dhidden, dweight) of ``linear_cross_entropy`` in kernel mode ``mode`` (the backward
    runs after the mode block, as in training)."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    with use_kernels(mode), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = linear_cross_entropy(h, w, labels, chunk=chunk)
    loss.backward()
    return loss.detach(), h.grad, w.grad


@pytest.fixture
def calls(monkeypatch):
    """Counts of the kernel launchers' calls."""
    counts = {"stats": 0, "grad": 0}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted
    monkeypatch.setattr(lce_kernels, "lce_stats", wrap("stats", lce_kernels.lce_stats))
    monkeypatch.setattr(lce_kernels, "lce_grad_", wrap("grad", lce_kernels.lce_grad_))
    return counts


@pytest.mark.interp
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.float32, True)])
def test_linear_cross_entropy_triton_matches_reference(calls, dtype, autocast):
    gen = torch.Generator().manual_seed(1)
    n, d, v, chunk = 37, 16, 1000, 16      # three chunks, the last one partial
    h, w = torch.randn(n, d, generator=gen, dtype=dtype), torch.randn(v, d, generator=gen, dtype=dtype) * 0.5
    labels = _labels(n, v, gen, ignore_every=5)
    want = _run("reference", h, w, labels, chunk, autocast)
    assert calls == {"stats": 0, "grad": 0}
    got = _run("triton", h, w, labels, chunk, autocast)
    assert calls == {"stats": math.ceil(n / chunk), "grad": math.ceil(n / chunk)}
    tol = 1e-2 if autocast else 1e-5
    for name, g, r in zip(("loss", "dhidden", "dweight"), got, want):
        assert g.dtype == r.dtype, name
        assert rel_err(g, r) <= tol, f"{name}: {rel_err(g, r):.2e}"
    # float64 keeps the PyTorch passes, in any mode
    got64 = _run("triton", h.double(), w.double(), labels, chunk)
    assert calls == {"stats": math.ceil(n / chunk), "grad": math.ceil(n / chunk)}
    for g, r in zip(got64, _run("reference", h.double(), w.double(), labels, chunk)):
        assert g.dtype == torch.float64 and torch.equal(g, r)


def test_sources_are_one_pass_each():
    stats = render_lce.render_stats(LceRegion(io_dtype="fp32", hints=(("szm", 8),)))
    assert_in_order(stats, "def lce_stats(z_ptr, lab_ptr, lse_ptr, loss_ptr, M, V, szm, ignore_index",
                    "ro = tl.multiple_of(((rows) * szm), 8)", "valid = lab != ignore_index",
                    "for v0 in range(0, V, BV):", "tl.load(ptrs", "new_max = tl.maximum(run_max, tl.max(x, 1))",
                    "run_sum = run_sum * tl.exp(run_max - new_max)",
                    "lse = run_max + tl.log(tl.where(m_r, run_sum, 1.0))",
                    "target = tl.load(z_ptr + ro + lab", "tl.store(lse_ptr", "tl.store(loss_ptr")
    assert stats.count("tl.load(") == 3 and "tl.store(ptrs" not in stats
    grad = render_lce.render_grad(LceRegion(io_dtype="bf16"))
    assert_in_order(grad, "def lce_grad(z_ptr, lse_ptr, lab_ptr, scale_ptr, M, V, szm", "ro = ((rows) * szm)",
                    "tl.load(scale_ptr)", "for v0 in range(0, V, BV):", "x = tl.load(ptrs",
                    "tl.exp(x - lse[:, None])", "tl.where(valid[:, None], g, 0.0)",
                    "tl.store(ptrs, g.to(z_ptr.dtype.element_ty), mask=mask)")
    assert "_to_bf16" not in grad
    rounded = render_lce.render_grad(LceRegion(io_dtype="bf16", round_bf16=True))
    assert_in_order(rounded, "round_bf16", "def _to_bf16(v):", "def lce_grad(", "tl.store(ptrs, _to_bf16(g)")
    compile(rounded, "lce_grad", "exec")
