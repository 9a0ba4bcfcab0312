"""Rematerialisation with the generated kernels (under the Triton interpreter): the replayed
regions run under the forward's kernel mode, so gradients equal those without remat bit for bit.
(Backward runs outside the compiled module's ``use_kernels`` context; before the regions carried
the mode, the replay fell back to the reference ops and the gradients differed in the last bits.)"""
from __future__ import annotations

import pytest
import torch

import mambac
from tests.models.tiny import tiny_lm


@pytest.mark.interp
def test_full_remat_with_kernels_gives_bit_identical_gradients():
    model = tiny_lm("mamba2", n_layer=2)
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 37, (1, 12), generator=g), torch.randint(0, 37, (1, 12), generator=g)

    def grads(**options):
        compiled = mambac.compile(model, kernels="triton", example_inputs=(ids, labels), **options)
        for p in model.parameters():
            p.grad = None
        compiled(ids, labels).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}

    plain, remat = grads(), grads(remat="full")
    assert sorted(plain) == sorted(remat)
    assert [k for k in plain if not torch.equal(plain[k], remat[k])] == []
