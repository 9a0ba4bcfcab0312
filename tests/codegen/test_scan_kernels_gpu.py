"""GPU tier of the generated scan kernels: selective scan, Mamba-3 SISO and MIMO on CUDA at model-like
and awkward shapes, forward and every input gradient, against a float64 run of each op's
reference on the GPU; and the ops dispatch to them in the default ('auto') kernel mode.  Run on a
CUDA machine where mambac is installed (``import mambac.passes`` must work), with the Triton
interpreter off (Triton imported before ``conftest.py`` runs):

    python -c "import triton, pytest, sys; sys.exit(pytest.main(['tests/codegen/test_scan_kernels_gpu.py']))"

``benchmarks/bench_scans.py check`` runs the same comparisons without installing mambac.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _ss_args(b, d, l, n, g, dtype):
    bc = (b, n, l) if g == 0 else (b, g, n, l)
    a = [torch.randn(b, d, l), torch.randn(b, d, l) * 0.5 - 1.0, -torch.rand(d, n) - 0.3, torch.randn(*bc),
         torch.randn(*bc), torch.randn(d), torch.randn(b, d, l), torch.randn(d) * 0.3, torch.randn(b, d, n)]
    return [t.cuda().to(dtype if i in (0, 1, 3, 4, 6) else torch.float32) for i, t in enumerate(a)] + [True]


def _m3_args(b, l, h, p, n, g, s, dtype):
    dt = F.softplus(torch.randn(b, l, h) - 1.0)
    a = [torch.randn(b, l, h, p), torch.randn(b, l, g, n), torch.randn(b, l, g, n), dt, -dt * (torch.rand(h) + 0.5),
         torch.randn(b, l, h), torch.randn(b, l, h, s), torch.randn(h, n) * 0.3, torch.randn(h, n) * 0.3,
         torch.randn(h), torch.randn(b, l, h, p), torch.randn(b, h, s), torch.randn(b, h, p, n),
         torch.randn(b, h, n), torch.randn(b, h, p)]
    return [t.cuda().to(dtype if i in (0, 1, 2, 10) else torch.float32) for i, t in enumerate(a)] + [64]


def _mimo_args(b, l, h, p, n, g, s, r, dtype):
    dt = F.softplus(torch.randn(b, l, h) - 1.0)
    a = [torch.randn(b, l, h, p), torch.randn(b, l, r, g, n), torch.randn(b, l, r, g, n), dt,
         -dt * (torch.rand(h) + 0.5), torch.randn(b, l, h), torch.randn(b, l, h, s), torch.randn(h, r, n) * 0.3,
         torch.randn(h, r, n) * 0.3, torch.randn(h, r, p), torch.randn(h, r, p), torch.randn(h, r, p),
         torch.randn(h), torch.randn(b, l, h, p), torch.randn(b, h, s), torch.randn(b, h, p, n),
         torch.randn(b, r, h, n), torch.randn(b, h, p)]
    return [t.cuda().to(dtype if i in (0, 1, 2, 13) else torch.float32) for i, t in enumerate(a)] + [16]


def _check(args, reference, forward, backward):
    dtype = args[0].dtype
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ref_in = [a.double().requires_grad_(True) if i in pos else a for i, a in enumerate(args)]
    refs = reference(*ref_in)
    gouts = [torch.randn_like(o, dtype=dtype if k == 0 else torch.float32) for k, o in enumerate(refs)]
    sum((o * g.double()).sum() for o, g in zip(refs, gouts)).backward()
    errs = {f"out{k}": rel_err(o, r) for k, (o, r) in enumerate(zip(forward(*args), refs))}
    grads = backward(args, gouts, [True] * len(args))
    errs.update({f"d{i}": rel_err(grads[i], ref_in[i].grad) for i in pos})
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, f"errors above {TOL[dtype]}: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 37, 301, 13, 0), (2, 512, 1000, 16, 4)], ids=["odd", "grouped"])
def test_selective_scan_kernels_on_cuda(shape, dtype):
    K = importlib.import_module("mambac.codegen.selective_scan_kernels")
    ref = importlib.import_module("mambac.ops.selective_scan").reference
    torch.manual_seed(0)
    _check(_ss_args(*shape, dtype), ref, K.selective_scan_forward, K.selective_scan_backward)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 211, 5, 24, 30, 1, 7), (1, 512, 8, 64, 64, 2, 16)], ids=["odd", "model"])
def test_mamba3_siso_kernels_on_cuda(shape, dtype):
    K = importlib.import_module("mambac.codegen.mamba3_kernels")
    ref = importlib.import_module("mambac.ops.mamba3_siso").reference
    torch.manual_seed(0)
    _check(_m3_args(*shape, dtype), ref, K.mamba3_siso_forward, K.mamba3_siso_backward)


@pytest.mark.parametrize("shape, dtype", [((2, 133, 3, 24, 30, 1, 5, 2), torch.float32),
                                          ((2, 133, 3, 24, 30, 1, 5, 2), torch.bfloat16),
                                          ((1, 512, 8, 64, 64, 2, 16, 4), torch.bfloat16)],
                         ids=["odd-fp32", "odd-bf16", "model-rank4-bf16"])
def test_mamba3_mimo_kernels_on_cuda(shape, dtype):
    K = importlib.import_module("mambac.codegen.mamba3_mimo_kernels")
    ref = importlib.import_module("mambac.ops.mamba3_mimo").reference
    torch.manual_seed(0)
    _check(_mimo_args(*shape, dtype), ref, K.mamba3_mimo_forward, K.mamba3_mimo_backward)


def test_ops_dispatch_to_the_kernels_on_cuda(monkeypatch):
    from mambac.ops import selective_scan
    K = importlib.import_module("mambac.codegen.selective_scan_kernels")
    calls = []
    orig = K.selective_scan_forward
    monkeypatch.setattr(K, "selective_scan_forward", lambda *a: calls.append(1) or orig(*a))
    args = _ss_args(1, 8, 50, 4, 0, torch.float32)
    selective_scan(*args[:5], D=args[5], delta_softplus=True)
    assert calls == [1]
