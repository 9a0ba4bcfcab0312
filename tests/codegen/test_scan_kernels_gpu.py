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

from tests.codegen.scan_cases import SCAN_OPS, TOL, scan_errors, selective_scan_args

pytestmark = pytest.mark.gpu


def _check(op: str, shape: tuple, dtype: torch.dtype) -> None:
    """``op``'s generated kernels at ``shape`` against its reference in float64, within ``TOL``."""
    kernels, make_args = SCAN_OPS[op]
    K = importlib.import_module(f"mambac.codegen.{kernels}")
    ref = importlib.import_module(f"mambac.ops.{op}").reference
    torch.manual_seed(0)
    errs = scan_errors(make_args(*shape, dtype), ref, getattr(K, f"{op}_forward"), getattr(K, f"{op}_backward"))
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, f"errors above {TOL[dtype]}: {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 37, 301, 13, 0), (2, 512, 1000, 16, 4)], ids=["odd", "grouped"])
def test_selective_scan_kernels_on_cuda(shape, dtype):
    _check("selective_scan", shape, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2, 211, 5, 24, 30, 1, 7), (1, 512, 8, 64, 64, 2, 16)], ids=["odd", "model"])
def test_mamba3_siso_kernels_on_cuda(shape, dtype):
    _check("mamba3_siso", shape, dtype)


@pytest.mark.parametrize("shape, dtype", [((2, 133, 3, 24, 30, 1, 5, 2), torch.float32),
                                          ((2, 133, 3, 24, 30, 1, 5, 2), torch.bfloat16),
                                          ((1, 512, 8, 64, 64, 2, 16, 4), torch.bfloat16)],
                         ids=["odd-fp32", "odd-bf16", "model-rank4-bf16"])
def test_mamba3_mimo_kernels_on_cuda(shape, dtype):
    _check("mamba3_mimo", shape, dtype)


def test_ops_dispatch_to_the_kernels_on_cuda(monkeypatch):
    from mambac.ops import selective_scan
    K = importlib.import_module("mambac.codegen.selective_scan_kernels")
    calls = []
    orig = K.selective_scan_forward
    monkeypatch.setattr(K, "selective_scan_forward", lambda *a: calls.append(1) or orig(*a))
    args = selective_scan_args(1, 8, 50, 4, 0, torch.float32)
    selective_scan(*args[:5], D=args[5], delta_softplus=True)
    assert calls == [1]
