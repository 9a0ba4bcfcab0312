"""Direct launches (codegen/direct_launch.py): the key is at least as fine as Triton's
specialisation, a repeat launch calls the compiled launcher with the constexprs in declaration
order, and every doubtful case goes through Triton's own path.  Runs on the CPU: CUDA's current
device and stream are stood in for, and the "compiled kernel" records its calls."""
from __future__ import annotations

import pytest
import torch

from mambac.codegen import direct_launch as dl


class FakeFn:
    arg_names = ["x_ptr", "n", "BM", "BK"]


class FakeCompiled:
    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail = fail

    def run(self, *a):
        if self.fail:
            raise TypeError("launcher takes other arguments")
        self.calls.append(a)


@pytest.fixture
def cuda_standin(monkeypatch):
    monkeypatch.setattr(dl, "_on_cuda", lambda args: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    monkeypatch.setattr(dl, "_hooks_installed", lambda: False)


def test_spec_key_follows_alignment_dtype_and_values():
    x = torch.zeros(64)
    base = dl.spec_key([x, 16])
    assert base == dl.spec_key([torch.zeros(64), 16])           # another tensor, same kinds
    assert dl.spec_key([x[1:], 16]) != base                     # 4 bytes off: not 16-byte aligned
    assert dl.spec_key([x.double(), 16]) != base                # dtype
    assert dl.spec_key([x, 17]) != base and dl.spec_key([x, 1]) != base
    assert dl.spec_key([x, True]) != dl.spec_key([x, 1])        # a bool is not the integer 1
    assert dl.spec_key([x, None]) == dl.spec_key([x, None])
    assert dl.spec_key([x, object()]) is None                   # unknown kind: Triton's path


def test_repeat_launch_is_direct_with_constexprs_in_declaration_order(cuda_standin):
    d = dl.DirectLaunches(FakeFn())
    compiled = FakeCompiled()
    slow_calls = []

    def slow():
        slow_calls.append(1)
        return compiled

    x = torch.zeros(64)
    consts = {"BK": 32, "BM": 64}   # keyword order differs from the declaration's
    d.launch((4, 2), [x, 10], consts, {"num_warps": 4}, slow)
    assert len(slow_calls) == 1 and not compiled.calls
    d.launch((4, 2), [x, 10], consts, {"num_warps": 4}, slow)
    assert len(slow_calls) == 1
    (call,) = compiled.calls
    assert call[:7] == (4, 2, 1, 77, "fn-handle", "meta", None)
    assert call[9:] == (x, 10, 64, 32)
    # anything Triton specialises on sends the launch through Triton again, once
    for args, options in (([x[1:], 10], {"num_warps": 4}), ([x, 11], {"num_warps": 4}),
                          ([x, 10], {"num_warps": 8})):
        d.launch((1,), args, consts, options, slow)
    assert len(slow_calls) == 4 and len(compiled.calls) == 1


def test_hooks_unknown_kinds_and_failures_take_tritons_path(cuda_standin, monkeypatch):
    x = torch.zeros(8)
    d = dl.DirectLaunches(FakeFn())
    compiled = FakeCompiled(fail=True)
    slow_calls = []

    def slow():
        slow_calls.append(1)
        return compiled

    d.launch((1,), [x, 3], {"BM": 1, "BK": 1}, {}, slow)
    d.launch((1,), [x, 3], {"BM": 1, "BK": 1}, {}, slow)      # the direct call raises: fall back
    assert len(slow_calls) == 2 and d.failed and not d.table
    d.launch((1,), [x, 3], {"BM": 1, "BK": 1}, {}, slow)
    assert len(slow_calls) == 3
    d2 = dl.DirectLaunches(FakeFn())
    d2.launch((1,), [x, object()], {"BM": 1, "BK": 1}, {}, slow)
    assert not d2.table
    monkeypatch.setattr(dl, "_hooks_installed", lambda: True)   # a profiler's launch hook
    d3 = dl.DirectLaunches(FakeFn())
    d3.launch((1,), [x, 3], {"BM": 1, "BK": 1}, {}, slow)
    assert not d3.table and len(slow_calls) == 5


def test_empty_hook_chains_are_not_hooks():
    class Chain:
        calls: list = []
    assert not dl._active(None) and not dl._active(Chain())
    chain = Chain()
    chain.calls = [print]
    assert dl._active(chain) and dl._active(print)


def test_cpu_tensors_never_launch_directly():
    assert not dl._on_cuda([torch.zeros(2), 3])
