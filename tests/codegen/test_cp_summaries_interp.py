"""The fused context-parallel SSD summaries (``codegen/cp_summaries_kernels``: the cumulative
log-decay of a piece), forward and backward, against ``ssd_summaries``' PyTorch form run in float64,
under the Triton interpreter at awkward shapes (lengths not a multiple of the tile, head counts not a
power of two, every combination of the dt prologue's steps); the dispatch in ``ssd_summaries``; and a
GPU-tier check at the benchmark shape.  Tolerances (relative, in norm): fp32 1e-4, bf16 1e-2.
"""
from __future__ import annotations

import math

import pytest
import torch

from mambac.codegen import cp_summaries_kernels as K
from mambac.ops import use_kernels
from mambac.runtime import context_parallel as cp
from tests.codegen.referee import compare_with_float64
from tests.helpers import rel_err

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _inputs(b, l, h, dtype, has_bias, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = (torch.randn(b, l, h, generator=gen, device=device) * 2.0).to(dtype)
    dt[0, 0, 0] = 25.0                       # above softplus' threshold: the identity branch
    A = -torch.rand(h, generator=gen, device=device) - 0.5
    bias = torch.randn(h, generator=gen, device=device) if has_bias else None
    dcum = torch.randn(b, l, h, generator=gen, device=device)
    return [dt, A, bias], dcum


def _compare(inputs, dcum, dtype, softplus, lo, hi):
    """Fused forward/backward vs the float64 PyTorch form on the same values."""
    def reference(dt, A, bias):
        with use_kernels("reference"):
            return cp.ssd_summaries(dt, A, bias, softplus, lo, hi, torch.float64)

    cum = compare_with_float64(lambda dt, A, bias: K.fused_summaries(dt, A, bias, softplus, lo, hi), reference,
                               inputs, dcum, TOL[dtype], ("dt", "A", "dt_bias"))
    assert cum.dtype == torch.float32


@pytest.mark.interp
@pytest.mark.parametrize("l,h,has_bias,softplus,lo,hi,dtype", [
    (70, 3, True, True, 0.0, math.inf, torch.float32),     # L over one tile, not a multiple; odd heads
    (37, 5, True, True, 0.05, 2.0, torch.float32),         # clamp active on both sides
    (64, 4, False, False, 0.0, math.inf, torch.float32),   # no prologue at all
    (19, 33, False, True, 0.0, 1.5, torch.float32),        # heads over one block
    (1100, 3, True, True, 0.0, math.inf, torch.float32),   # over one tile: the carry between tiles
    (70, 3, True, True, 0.0, math.inf, torch.bfloat16),
])
def test_fused_summaries_match_reference(l, h, has_bias, softplus, lo, hi, dtype):
    inputs, dcum = _inputs(2, l, h, dtype, has_bias, seed=l + h)
    _compare(inputs, dcum, dtype, softplus, lo, hi)


@pytest.mark.interp
def test_strided_dt():
    """dt as a column slice of the input projection (the mixer's layout) gives the same result."""
    gen = torch.Generator().manual_seed(4)
    proj = torch.randn(2, 21, 3 + 7, generator=gen)
    dt = proj[..., 7:]
    assert not dt.is_contiguous()
    _, A, bias = _inputs(2, 21, 3, torch.float32, True)[0]
    _compare([dt, A, bias], torch.randn(2, 21, 3, generator=gen), torch.float32, True, 0.0, math.inf)


@pytest.mark.interp
def test_ssd_summaries_dispatch(monkeypatch):
    """ssd_summaries takes the fused kernel for fp32 state math when kernels may run, the PyTorch
    form for float64 and under fake tensors (shape propagation)."""
    calls = []
    real = K.fused_summaries
    monkeypatch.setattr(K, "fused_summaries", lambda *a: calls.append(1) or real(*a))
    (dt, A, bias), _ = _inputs(1, 9, 2, torch.float32, True)
    with use_kernels("triton"):
        cum = cp.ssd_summaries(dt, A, bias, True, 0.0, math.inf, torch.float32)
        cp.ssd_summaries(dt.double(), A.double(), bias.double(), True, 0.0, math.inf, torch.float64)
    assert len(calls) == 1
    with use_kernels("reference"):
        ref = cp.ssd_summaries(dt, A, bias, True, 0.0, math.inf, torch.float32)
    assert rel_err(cum, ref) <= 1e-6
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), use_kernels("triton"):
        fake = cp.ssd_summaries(torch.empty(1, 9, 2), torch.empty(2), torch.empty(2), True, 0.0, math.inf,
                                torch.float32)
        assert fake.shape == cum.shape
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_summaries_gpu(dtype):
    """The benchmark's S1/4 shape (b4 l1024 h48) on CUDA, fwd + bwd."""
    inputs, dcum = _inputs(4, 1024, 48, dtype, True, device="cuda")
    _compare(inputs, dcum, dtype, True, 0.0, math.inf)
