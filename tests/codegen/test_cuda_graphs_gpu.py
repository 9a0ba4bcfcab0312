"""GPU tier: ``mambac.compile(..., cuda_graphs=True)`` trains exactly like the module without graphs.

A tiny Mamba-2 LM (fp32, generated kernels) is trained with an optimizer step per call, with and
without CUDA graphs: losses, every parameter gradient and the final parameters agree, a second input
shape is captured separately, and the capture and replay counts are checked.  Also: gradient
accumulation over two backward calls, two forwards before one backward (the second runs eagerly),
evaluation under no_grad (a forward-only graph), bf16 autocast, remat='full', a new capture after a
parameter's storage is replaced, and a clear error for a program that synchronises with the host.
Run on a CUDA machine with the Triton interpreter off:

    python -c "import triton, pytest, sys; sys.exit(pytest.main(['tests/codegen/test_cuda_graphs_gpu.py']))"
"""
from __future__ import annotations

import copy

import pytest
import torch

import mambac
from mambac.runtime.cuda_graphs import CudaGraphStats
from tests.helpers import rel_err
from tests.models.tiny import tiny_lm

pytestmark = [pytest.mark.gpu]
TOL = 1e-5


def _batches(shapes: list[tuple[int, int]], seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 37, (b, l + 1), device="cuda", generator=gen) for b, l in shapes]


def _twins(**options):
    """The same tiny LM twice on CUDA, compiled without and with CUDA graphs."""
    model = tiny_lm("mamba2").cuda()
    twin = copy.deepcopy(model)
    return mambac.compile(model, **options), mambac.compile(twin, cuda_graphs=True, **options)


def _train(lm, batches, accumulate: int = 1, autocast: bool = False) -> tuple[list, list]:
    """One AdamW step per batch (``accumulate`` backward calls before it); losses and gradients."""
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-2)
    losses, grads = [], []
    for batch in batches:
        for j in range(accumulate):  # micro-batches of one shape, different tokens
            ids = batch.roll(j, dims=1)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = lm(ids[:, :-1], ids[:, 1:])
            loss.backward()
            losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in lm.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=False)  # in place: the stored .grad must not alias a graph buffer
    return losses, grads


def _assert_same(a, b, tol: float = TOL) -> None:
    (la, ga), (lb, gb) = a, b
    assert len(la) == len(lb) and len(ga) == len(gb)
    errs = [rel_err(x, y) for x, y in zip(la, lb)]
    assert max(errs) <= tol, ("losses", errs)
    for step, (x, y) in enumerate(zip(ga, gb)):
        bad = {n: rel_err(x[n], y[n]) for n in y if not rel_err(x[n], y[n]) <= tol}
        assert not bad, (step, bad)


def test_training_matches_without_graphs_and_shapes_are_captured_once():
    eager, graphed = _twins()
    batches = _batches([(2, 16)] * 3 + [(3, 8)] * 2)
    _assert_same(_train(graphed, batches), _train(eager, batches))
    assert graphed.cuda_graph_stats == CudaGraphStats(captured=2, replays=5, eager=0)
    for (n, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert rel_err(q, p) <= TOL, n  # every optimizer step was seen by the next replay
    with torch.no_grad():  # evaluation: a forward-only graph of its own
        ids = batches[0]
        for _ in range(2):
            assert rel_err(graphed(ids[:, :-1]), eager(ids[:, :-1])) <= TOL
    assert graphed.cuda_graph_stats == CudaGraphStats(captured=3, replays=7, eager=0)


def test_gradient_accumulation_and_two_forwards_before_backward():
    eager, graphed = _twins()
    batches = _batches([(2, 16)] * 2)
    _assert_same(_train(graphed, batches, accumulate=2), _train(eager, batches, accumulate=2))
    assert graphed.cuda_graph_stats == CudaGraphStats(captured=1, replays=4, eager=0)
    ids = batches[0]
    for lm in (eager, graphed):
        lm.zero_grad(set_to_none=True)
        (lm(ids[:, :-1], ids[:, 1:]) + 2 * lm(ids[:, 1:], ids[:, :-1])).backward()
    assert graphed.cuda_graph_stats.eager == 1  # the second forward came before the first's backward
    for (n, p), q in zip(eager.named_parameters(), graphed.parameters()):
        assert rel_err(q.grad, p.grad) <= TOL, n


def test_bf16_autocast_and_remat():
    eager, graphed = _twins()
    batches = _batches([(2, 16)] * 2)
    a, b = _train(graphed, batches, autocast=True), _train(eager, batches, autocast=True)
    assert max(rel_err(x, y) for x, y in zip(a[0], b[0])) <= 1e-3
    eager, graphed = _twins(remat="full")
    _assert_same(_train(graphed, batches), _train(eager, batches))
    assert graphed.cuda_graph_stats == CudaGraphStats(captured=1, replays=2, eager=0)


def test_replaced_parameter_is_captured_again():
    eager, graphed = _twins()
    batches = _batches([(2, 16)] * 2)
    for lm in (eager, graphed):
        lm(batches[0][:, :-1], batches[0][:, 1:]).backward()
        w = lm.original_module.lm_head.weight
        w.data = w.data * 0.5  # new storage: the graph's in-place read would miss it
    _assert_same(_train(graphed, batches[1:]), _train(eager, batches[1:]))
    assert graphed.cuda_graph_stats == CudaGraphStats(captured=2, replays=2, eager=0)


class _Syncs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return ((x * self.w).cpu() * 2).to(x.device).sum()  # a device-to-host copy inside the program


def test_program_that_syncs_with_the_host_is_rejected_clearly():
    x = torch.randn(3, 4, device="cuda")
    lm = mambac.compile(_Syncs().cuda(), cuda_graphs=True, example_inputs=(x,))
    with pytest.raises(mambac.MambacRuntimeError, match="synchronises with the host.*without cuda_graphs=True"):
        lm(x)
    plain = mambac.compile(lm.original_module)
    plain(x).backward()  # CUDA is left usable
    assert torch.equal(lm.original_module.w.grad, 2 * x.sum(0))
