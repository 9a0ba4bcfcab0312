"""Activation checkpointing under ``torch.compile(backend="mambac")``: the bodies of
``torch.utils.checkpoint`` regions are lowered like the graph around them
(``mambac/backend_regions.py``), and what cannot reach mambac is named with what to do."""
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


def _parity(model, compiled, x) -> None:
    params = [x] + list(model.parameters())
    out_c, out_e = compiled(x), model(x)
    assert rel_err(out_c, out_e) <= 1e-6
    cot = torch.randn_like(out_e)
    for a, b in zip(torch.autograd.grad((out_c * cot).sum(), params), torch.autograd.grad((out_e * cot).sum(), params)):
        assert rel_err(a, b) <= 1e-5


def test_mixers_inside_checkpoint_regions_are_fused_there():
    model, backend = _Checkpointed(), MambacBackend()
    _parity(model, torch.compile(model, backend=backend), torch.randn(2, 9, 16, requires_grad=True))
    (lowered,) = backend.graphs
    assert lowered.ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}
    fused = lowered.ctx.stats["fuse_ssm"].counts
    assert (fused["dt_prologue"], fused["d_skip"], fused["conv_silu"]) == (2, 2, 2)
    for body in ("wrap_body_0", "wrap_body_1"):   # the fused ops sit in the bodies, whose inputs are unchanged
        targets = [str(n.target) for n in getattr(lowered.gm, body).graph.nodes if n.op == "call_function"]
        assert "mambac.ssd" in targets and "softplus" not in " ".join(targets)


def test_a_region_that_does_not_lower_runs_as_traced_and_is_named(monkeypatch, caplog):
    import mambac.passes.runner as runner
    from mambac.errors import MambacPassError

    def refuses(gm, ctx, passes):
        if not any(n.op == "get_attr" for n in gm.graph.nodes):   # a body (the outer graph holds them)
            raise MambacPassError("refused for the test")
        return real(gm, ctx, passes)
    real = runner.run_passes
    monkeypatch.setattr(runner, "run_passes", refuses)
    model = _Checkpointed()
    with caplog.at_level("WARNING", logger="mambac"):
        _parity(model, torch.compile(model, backend=MambacBackend()), torch.randn(2, 9, 16, requires_grad=True))
    text = caplog.text
    for body in ("wrap_body_0", "wrap_body_1"):
        assert f"the checkpoint region {body} runs as dynamo traced it, unfused: refused for the test" in text
    assert "2 mixer(s) (mix.0, mix.1) sit inside torch.utils.checkpoint regions" in text and "'remat': 'full'" in text


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
