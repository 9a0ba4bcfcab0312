"""Activation checkpointing under ``torch.compile(backend="mambac")``: what reaches mambac, and
the warnings that say what runs unfused and what to use instead."""
from __future__ import annotations

import torch

from mambac.backend import MambacBackend
from tests.convert.hf_models import hf_model
from tests.helpers import rel_err
from tests.test_backend import _fresh_dynamo  # noqa: F401  (autouse: a fresh dynamo and counters per test)


class _Checkpointed(torch.nn.Module):
    """mambac mixers inside torch.utils.checkpoint: dynamo hands each region over as a sub-graph."""

    def __init__(self) -> None:
        super().__init__()
        from mambac.models.mamba2 import Mamba2
        torch.manual_seed(0)
        self.mix = torch.nn.ModuleList([Mamba2(d_model=16, d_state=8, headdim=8, chunk_size=4) for _ in range(2)])

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for layer in self.mix:
            x = x + checkpoint(layer, x, use_reentrant=False)
        return x


def test_mixers_inside_checkpoint_regions_are_named_with_the_remat_hint(caplog):
    model, x = _Checkpointed(), torch.randn(2, 9, 16)
    with caplog.at_level("WARNING", logger="mambac"):
        out = torch.compile(model, backend=MambacBackend())(x)
    assert rel_err(out, model(x)) <= 1e-6
    text = caplog.text
    assert "2 mixer(s) (mix.0, mix.1) sit inside torch.utils.checkpoint regions" in text and "'remat': 'full'" in text
    assert "mambac.convert.convert" not in text   # that hint is for foreign mixers


def test_transformers_gradient_checkpointing_is_named_once_with_the_remat_hint(caplog):
    model = hf_model("mamba2_lm_groups").train()
    model.gradient_checkpointing_enable()
    compiled = torch.compile(model, backend=MambacBackend())
    ids = torch.randint(0, 37, (2, 9))
    with caplog.at_level("WARNING", logger="mambac"):
        for _ in range(2):
            out = compiled(ids, use_cache=False).logits
    assert rel_err(out, model(ids, use_cache=False).logits) <= 1e-5
    said = [r.getMessage() for r in caplog.records if "gradient checkpointing on" in r.getMessage()]
    assert len(said) == 1 and "gradient_checkpointing_disable()" in said[0] and "'remat': 'full'" in said[0]
