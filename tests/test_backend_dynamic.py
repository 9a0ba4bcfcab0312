"""``torch.compile(model, backend="mambac", dynamic=True)``: sizes symbolic from the first call, and
Python floats (a mixer's ``dt_limit``, a norm's ``eps``) handed over as tensors read with
``.item()``, which mambac bakes back into numbers behind a guard (``mambac/backend_scalars.py``)."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.fx
from torch._dynamo.utils import counters

from mambac import ops
from mambac.backend import MambacBackend
from mambac.backend_scalars import bake, guard_scalars
from tests.helpers import rel_err
from tests.models.tiny import tiny_lm
from tests.test_backend import _fresh_dynamo  # noqa: F401  (autouse: a fresh dynamo and counters per test)


def _grads(model, loss) -> list[torch.Tensor]:
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("name", ["mamba1", "mamba2_groups_hdimD_nonorm_limit", "mamba3_siso"])
def test_dynamic_lms_lower_every_mixer_and_match_eager(name):
    model = tiny_lm(name)
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for seqlen in (9, 14):
        ids, labels = torch.randint(0, 37, (2, seqlen)), torch.randint(0, 37, (2, seqlen))
        loss_c, loss_e = compiled(ids, labels), model(ids, labels)
        assert rel_err(loss_c, loss_e) <= 1e-5
        for a, b in zip(_grads(model, loss_c), _grads(model, loss_e)):
            assert rel_err(a, b) <= 1e-5
    assert counters["stats"]["unique_graphs"] == 1 and sum(counters["graph_break"].values()) == 0
    lowered = backend.graphs[-1]
    assert lowered.ctx.stats["backend"].counts["mixers.lowered"] == 2
    assert not any(n.op == "call_method" and n.target == "item" for n in lowered.gm.graph.nodes)


class _Limited(torch.nn.Module):
    """A bare ``ssd`` whose clamp comes in as call arguments: floats dynamo does not specialise."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.A = torch.nn.Parameter(-torch.rand(3))

    def forward(self, x, dt, B, C, lo: float, hi: float):
        return ops.ssd(x, dt, self.A, B, C, chunk_size=4, dt_softplus=True, dt_limit=(lo, hi))


def test_a_changed_float_argument_is_not_served_the_baked_value():
    model = _Limited()
    compiled = torch.compile(model, backend=MambacBackend(), dynamic=True)
    x, dt = torch.randn(2, 10, 3, 4), torch.randn(2, 10, 3)
    B, C = torch.randn(2, 10, 1, 8), torch.randn(2, 10, 1, 8)
    for lo, hi in ((0.0, 0.5), (0.0, 0.25), (0.1, 0.5)):
        assert rel_err(compiled(x, dt, B, C, lo, hi), model(x, dt, B, C, lo, hi)) <= 1e-6, (lo, hi)


def _scaled_graph() -> torch.fx.GraphModule:
    """x * float(s), with s a 0-d tensor read by ``.item()``: the form dynamo gives an unspecialised float."""
    g = torch.fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    number = g.call_function(torch.sym_float, (g.call_method("item", (s,)),))
    g.output((g.call_function(torch.mul, (x, number)),))
    return torch.fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("boxed", [False, True])
def test_baked_numbers_are_guarded_on_every_call(boxed):
    gm, x = _scaled_graph(), torch.randn(4)
    baked, traced = bake(gm, [x, torch.tensor(2.0, dtype=torch.float64)])
    assert baked == [(1, 2.0)] and traced is not None
    assert not any(n.op == "call_method" for n in gm.graph.nodes)   # the read is gone: x * 2.0
    mul = next(n for n in gm.graph.nodes if n.target is torch.mul)
    assert mul.args[1] == 2.0

    def compiled(*args):
        flat = args[0] if boxed else args
        return gm(*flat)
    compiled._boxed_call = boxed
    run = guard_scalars(compiled, traced, baked)
    for value in (2.0, 3.0, 2.0):
        args = [x, torch.tensor(value, dtype=torch.float64)]
        (out,) = run(args) if boxed else run(*args)
        assert torch.equal(out, x * value), value
    assert run._boxed_call is boxed


def test_casts_of_plain_numbers_are_folded():
    """torch 2.11 leaves ``torch.sym_float(1e-05)`` where it specialised a float it had read."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output((g.call_function(torch.mul, (x, g.call_function(torch.sym_float, (2,)))),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert bake(gm, [torch.randn(3)]) == ([], None)
    mul = next(n for n in gm.graph.nodes if n.target is torch.mul)
    assert mul.args[1] == 2.0 and isinstance(mul.args[1], float)
    assert not any(n.target is torch.sym_float for n in gm.graph.nodes)


def test_inputs_read_other_ways_are_not_baked():
    g = torch.fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    g.output((g.call_function(torch.mul, (x, s)),))   # the 0-d tensor used as a tensor
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert bake(gm, [torch.randn(3), torch.tensor(2.0)]) == ([], None)
