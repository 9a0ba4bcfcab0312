"""A model that calls ``torch.utils.checkpoint`` under ``mambac.compile``: the calls are traced
through (counted), the result equals eager, and without ``remat`` a warning says that nothing is
recomputed and which options recompute."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.utils.checkpoint as ckpt

import mambac
from mambac.models.mamba2 import Mamba2
from tests.helpers import rel_err


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant
        self.mix = torch.nn.ModuleList([Mamba2(d_model=16, d_state=8, headdim=8, chunk_size=4) for _ in range(2)])

    def forward(self, x):
        for layer in self.mix:
            x = x + ckpt.checkpoint(layer, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_calls_are_traced_through_and_named(reentrant):
    originals = (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction)
    model = _Checkpointed(reentrant)
    x = torch.randn(2, 9, 16)
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    with pytest.warns(UserWarning, match=r"calls torch.utils.checkpoint \(2 call\(s\) in one forward\).*remat='full'"):
        out = mambac.compile(model)(xc)
    assert (ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction) == originals   # restored
    out.sum().backward()   # (.backward(): the reentrant form refuses autograd.grad)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(xe)
    ref.sum().backward()
    assert rel_err(out, ref) <= 1e-6 and rel_err(xc.grad, xe.grad) <= 1e-5
    for a, p in zip(grads, model.parameters()):
        assert rel_err(a, p.grad) <= 1e-5


def test_with_remat_nothing_is_said():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mambac.compile(_Checkpointed(False), remat="full")(torch.randn(2, 9, 16))
