"""A model that calls ``torch.utils.checkpoint`` under ``mambac.compile``: capture traces the calls
through and records what each checkpoints; a checkpointed submodule becomes a recompute region
(as ``remat='full'`` makes of a block), anything else is named in a warning with the options that
recompute."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as ckpt

import mambac
from mambac.memory import MEMORY_PLAN
from mambac.models.mamba2 import Mamba2
from tests.helpers import rel_err


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool = False, how: str = "module") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant, self.how = reentrant, how
        self.mix = torch.nn.ModuleList([Mamba2(d_model=16, d_state=8, headdim=8, chunk_size=4) for _ in range(2)])

    def forward(self, x):
        for layer in self.mix:
            if self.how == "none":   # the same model without checkpoints
                x = x + layer(x)
                continue
            fn = layer if self.how == "module" else (lambda t, m=layer: m(t))
            x = x + ckpt.checkpoint(fn, x, use_reentrant=self.reentrant)
        return x


def _parity(model, compiled, x) -> None:
    """Outputs and every gradient (the input's too) equal eager's (.backward(): the reentrant form
    refuses autograd.grad)."""
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = compiled(xc)
    out.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(xe)
    ref.sum().backward()
    assert rel_err(out, ref) <= 1e-6 and rel_err(xc.grad, xe.grad) <= 1e-5
    for a, p in zip(grads, model.parameters()):
        assert rel_err(a, p.grad) <= 1e-5


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_submodules_become_recompute_regions(reentrant):
    originals = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)
    model = _Checkpointed(reentrant)
    compiled = mambac.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        program = compiled.program_for(torch.randn(2, 9, 16))
    assert (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) == originals   # restored
    plan = program.gm.meta[MEMORY_PLAN]
    assert plan.mode == "checkpoint" and [r.name for r in plan.regions] == ["remat_mix_0", "remat_mix_1"]
    assert plan.predicted < plan.baseline   # the regions' insides are no longer kept
    assert {n.target for n in program.gm.graph.nodes if n.op == "call_module"} >= {"remat_mix_0", "remat_mix_1"}
    _parity(model, compiled, torch.randn(2, 9, 16))


def test_a_checkpointed_function_that_is_not_a_submodule_is_named():
    model = _Checkpointed(how="lambda")
    compiled = mambac.compile(model)
    with pytest.warns(UserWarning, match=r"\(2 call\(s\) in one forward\), but a checkpointed function is not a "
                                         r"submodule of the model.*remat='full'"):
        program = compiled.program_for(torch.randn(2, 9, 16))
    assert MEMORY_PLAN not in program.gm.meta
    _parity(model, compiled, torch.randn(2, 9, 16))


def test_with_remat_the_option_decides():
    compiled = mambac.compile(_Checkpointed(), remat="full")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compiled.program_for(torch.randn(2, 9, 16)).gm.meta[MEMORY_PLAN].mode == "full"
