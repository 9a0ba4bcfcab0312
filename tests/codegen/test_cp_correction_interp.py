"""The fused context-parallel SSD correction (``codegen/cp_correction_kernels``), forward and
backward, against ``ssd_correction``'s PyTorch form run in float64 (exact there), under the Triton
interpreter at small awkward shapes; the dispatch in ``ssd_correction``; and a GPU-tier check at
the benchmark shape.

Half-precision cases give the kernels inputs already rounded to bf16 and the referee the same
values in float64.  Tolerances (relative, in norm): fp32 1e-4, bf16 1e-2.
"""
from __future__ import annotations


import pytest
import torch

from mambac.codegen import cp_correction_kernels as K
from mambac.ops import kernels_enabled, use_kernels
from mambac.runtime import context_parallel as cp
from tests.codegen.referee import compare_with_float64
from tests.helpers import rel_err

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _inputs(b, l, h, p, n, g, has_z, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    y0 = rnd(b, l, h, p).to(dtype)
    C = rnd(b, l, g, n).to(dtype)
    cum = -(torch.rand(b, l, h, generator=gen, device=device) * 0.2).cumsum(1)   # fp32, decreasing
    s_in = rnd(b, h, p, n, scale=0.5)                                               # fp32 state
    z = rnd(b, l, h, p).to(dtype) if has_z else None
    dy = rnd(b, l, h, p).to(dtype)
    return [y0, C, cum, s_in, z], dy


def _reference(*args):
    with use_kernels("reference"):
        return cp.ssd_correction(*args)


def _compare(inputs, dy, dtype):
    """Fused forward/backward vs the float64 PyTorch form on the same values."""
    y = compare_with_float64(K.fused_correction, _reference, inputs, dy, TOL[dtype],
                             ("y0", "C", "cum", "s_in", "z"))
    assert y.dtype == inputs[0].dtype


@pytest.mark.interp
@pytest.mark.parametrize("l,h,g,p,n,has_z,dtype", [
    (21, 4, 1, 8, 16, True, torch.float32),     # L not a multiple of the block
    (19, 4, 2, 8, 16, False, torch.float32),    # two groups, no gate
    (35, 6, 2, 12, 20, True, torch.float32),    # p, n not powers of two; 3 heads per group
    (21, 4, 1, 8, 16, True, torch.bfloat16),
    (19, 4, 2, 8, 16, False, torch.bfloat16),
])
def test_fused_correction_matches_reference(l, h, g, p, n, has_z, dtype):
    inputs, dy = _inputs(2, l, h, p, n, g, has_z, dtype, seed=l + h)
    _compare(inputs, dy, dtype)


@pytest.mark.interp
def test_strided_inputs():
    """C and z as column slices of one projection (the mixer's layout) give the same result."""
    b, l, h, p, n = 1, 18, 2, 8, 16
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(b, l, h * p + n + 5, generator=gen)
    z = proj[..., :h * p].unflatten(-1, (h, p))
    C = proj[..., h * p:h * p + n].unsqueeze(2)
    y0 = torch.randn(b, l, h, p, generator=gen)
    cum = -(torch.rand(b, l, h, generator=gen) * 0.2).cumsum(1)
    s_in = torch.randn(b, h, p, n, generator=gen)
    assert not z.is_contiguous() and not C.is_contiguous()
    _compare([y0, C, cum, s_in, z], torch.randn(b, l, h, p, generator=gen), torch.float32)


@pytest.mark.interp
def test_ssd_correction_dispatch(monkeypatch):
    """ssd_correction takes the fused kernel when kernels may run, the PyTorch form otherwise."""
    calls = []
    real = K.fused_correction
    monkeypatch.setattr(K, "fused_correction", lambda *a: calls.append(1) or real(*a))
    inputs, _ = _inputs(1, 9, 2, 8, 16, 1, True, torch.float32)
    with use_kernels("triton"):
        assert kernels_enabled("cpu")            # the tests run under TRITON_INTERPRET=1
        y = cp.ssd_correction(*inputs)
        cp.ssd_correction(*[a.double() if a is not None else None for a in inputs])   # float64: reference
    assert len(calls) == 1
    with use_kernels("reference"):
        y_ref = cp.ssd_correction(*inputs)
    assert len(calls) == 1
    assert rel_err(y, y_ref) <= 1e-5
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), use_kernels("triton"):     # shape propagation: the PyTorch form, no launch
        fake = [torch.empty(a.shape, dtype=a.dtype) if a is not None else None for a in inputs]
        assert cp.ssd_correction(*fake).shape == y.shape
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_correction_gpu(dtype):
    """The benchmark's S1/4 shape (b4 l1024 h48 p64 n128 g1) on CUDA, gated, fwd + bwd."""
    inputs, dy = _inputs(4, 1024, 48, 64, 128, 1, True, dtype, device="cuda")
    _compare(inputs, dy, dtype)
