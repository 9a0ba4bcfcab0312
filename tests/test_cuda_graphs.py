"""``cuda_graphs=True`` on the CPU: the compile-time errors (no CUDA, CPU parameters, gloo), and
the pieces of ``mambac.runtime.cuda_graphs`` that need no GPU (signatures, the leaves a program's
gradients go to).  The captures themselves are checked in tests/codegen/test_cuda_graphs_gpu.py."""
from __future__ import annotations

import pytest
import torch

import mambac
from mambac.errors import MambacInputError, MambacOptionsError
from mambac.runtime.cuda_graphs import CudaGraphs, _aliased, _leaves_of
from tests.models.tiny import tiny_lm

DROP = "[Dd]rop cuda_graphs=True"


def _ids(b: int = 2, l: int = 9) -> torch.Tensor:
    return torch.randint(0, 37, (b, l), generator=torch.Generator().manual_seed(0))


def test_rejected_on_cpu_before_anything_changes():
    model = tiny_lm("mamba2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MambacOptionsError, match="cuda_graphs=True needs CUDA tensors.*" + DROP):
        mambac.compile(model, cuda_graphs=True, example_inputs=(_ids(),))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rejected_for_cpu_parameters(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(MambacOptionsError, match="parameters or buffers on cpu.*model.cuda()"):
        mambac.compile(tiny_lm("mamba2"), cuda_graphs=True)


def test_rejected_under_gloo():
    import torch.distributed as dist
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(MambacOptionsError, match="needs CUDA tensors and NCCL.*process group uses 'gloo'.*" + DROP):
            mambac.compile(tiny_lm("mamba2"), world_size=2, tp=2, cuda_graphs=True)
    finally:
        dist.destroy_process_group()


def test_off_by_default():
    lm = mambac.compile(tiny_lm("mamba2"))
    assert lm.options.cuda_graphs is False and lm.cuda_graph_stats is None


def test_signature_tells_calls_apart():
    graphs, program = CudaGraphs(), object()
    a, b = _ids(), _ids(3)
    sig = graphs.signature(program, [a, None])
    assert sig == graphs.signature(program, [a.clone(), None])
    assert sig != graphs.signature(program, [b, None])             # shape
    assert sig != graphs.signature(program, [a, a])                # which inputs are given
    assert sig != graphs.signature(program, [a.int(), None])       # dtype
    assert sig != graphs.signature(object(), [a, None])            # program
    with torch.no_grad():
        assert sig != graphs.signature(program, [a, None])         # grad mode
    x = torch.randn(2, 3)
    assert graphs.signature(program, [x]) != graphs.signature(program, [x.requires_grad_()])
    with pytest.raises(MambacInputError, match="neither a tensor nor a hashable constant"):
        graphs.signature(program, [a, [1, 2]])


def test_leaves_are_the_parameters_the_loss_depends_on():
    model = tiny_lm("mamba2")
    lm = mambac.compile(model)
    ids = _ids()
    loss = lm(ids[:, :-1], ids[:, 1:])
    assert {id(p) for p in _leaves_of([loss], [])} == {id(p) for p in model.parameters()}
    x = torch.randn(3, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3))
    assert [id(t) for t in _leaves_of([(x * w).sum()], [x])] == [id(w)]


def test_warm_up_and_capture_run_on_parameter_aliases():
    """The program reads aliases (same storage, fresh leaves) of every trainable parameter, tied
    ones included, so its gradients never reach the parameters' own accumulators; restored after."""
    model = tiny_lm("mamba2")
    ids = _ids()
    gm = mambac.compile(model).program_for(ids[:, :-1], ids[:, 1:]).gm
    params = list(dict.fromkeys(gm.parameters()))
    alias = {id(p): p.detach().requires_grad_() for p in params}
    with _aliased(gm, alias):
        loss = gm(ids[:, :-1], ids[:, 1:])
    assert {id(t) for t in _leaves_of([loss], [])} == {id(a) for a in alias.values()}
    assert all(a.data_ptr() == p.data_ptr() for p in params for a in [alias[id(p)]])
    assert [id(p) for p in dict.fromkeys(gm.parameters())] == [id(p) for p in params]
    loss.backward()
    assert all(p.grad is None for p in params)
