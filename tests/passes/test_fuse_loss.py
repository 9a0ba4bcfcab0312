"""fuse_loss: the LM's head + cross-entropy become one linear_cross_entropy node at world_size 1
(printed graph, count, loss and every gradient equal to eager), the cases that must not fuse, the
saved-for-backward bytes it removes, and the memory model / remat planner on the fused graph."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mambac
from mambac.memory import analyse, explain_memory, measure_saved
from mambac.ops.linear_cross_entropy import linear_cross_entropy
from mambac.passes.pipeline import pipeline_for
from mambac.options import CompileOptions
from tests.helpers import rel_err
from tests.models.tiny import tiny_lm


def batch(b=2, l=12, vocab=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, labels = torch.randint(0, vocab, (b, l), generator=g), torch.randint(0, vocab, (b, l), generator=g)
    labels[:, ::5] = -100
    return ids, labels


def fused_count(compiled):
    return next(iter(compiled.programs.values())).ctx.stats["fuse_loss"].counts.get("linear_cross_entropy", 0)


class Head(nn.Module):
    """A hand-written head + loss in several spellings."""

    def __init__(self, d=8, v=13, bias=False, spelling="flatten", leak_logits=False, **ce):
        super().__init__()
        self.proj, self.head = nn.Linear(d, d), nn.Linear(d, v, bias=bias)
        self.spelling, self.leak, self.ce = spelling, leak_logits, ce

    def forward(self, x, labels):
        logits = self.head(torch.tanh(self.proj(x)))
        flat = logits.float().flatten(0, 1) if self.spelling == "flatten" else logits.contiguous().view(-1, 13)
        loss = F.cross_entropy(flat, labels.flatten(), **self.ce)
        return (loss, logits) if self.leak else loss

    def example_inputs(self):
        g = torch.Generator().manual_seed(1)
        labels = torch.randint(0, 13, (3, 5), generator=g)
        labels[0, :2] = 7
        return torch.randn(3, 5, 8, generator=g), labels


def test_lm_loss_fuses_into_one_node_and_matches_eager():
    model = tiny_lm("mamba2")
    ids, labels = batch()
    compiled = mambac.compile(model, example_inputs=(ids, labels))
    assert fused_count(compiled) == 1
    text = compiled.lowered_graph_text()
    line = next(ln.strip() for ln in text.splitlines() if "linear_cross_entropy(" in ln)
    assert "self.lm_head.weight" in text and "fused: linear_cross_entropy | lm_head" in line and line.endswith(
        "| lm_head") and ", -100)" in line
    assert "self.lm_head(" not in text and "F.cross_entropy" not in text
    loss_c = compiled(ids, labels)
    loss_c.backward()
    grads_c = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    loss_e = model(ids, labels)
    loss_e.backward()
    assert loss_c.dtype == loss_e.dtype == torch.float32 and rel_err(loss_c, loss_e) <= 1e-5
    for k, p in model.named_parameters():
        assert rel_err(grads_c[k], p.grad) <= 1e-5, k
    assert compiled(ids, None).shape == (2, 12, 40)   # the logits program is untouched


def test_fused_lm_saves_fewer_bytes_and_the_model_predicts_them():
    model = tiny_lm("mamba2")
    ids, labels = batch(2, 12)
    exclude = [*model.parameters(), ids, labels]
    saved, predicted = {}, {}
    for name, off in (("fused", ()), ("unfused", ("fuse_loss",))):
        compiled = mambac.compile(model, example_inputs=(ids, labels), disable_passes=off)
        saved[name] = measure_saved(compiled, ids, labels, exclude=exclude).nbytes
        predicted[name] = analyse(compiled.program_for(ids, labels).gm).predict()
        assert abs(predicted[name] - saved[name]) <= 0.10 * saved[name], (name, predicted, saved)
    vocab, tokens = 40, 2 * 12
    # the fp32 logits (a softmax-sized buffer) are no longer kept; N fp32 log-sum-exps are
    assert saved["unfused"] - saved["fused"] >= 4 * tokens * vocab - 4 * tokens, saved


def test_explain_and_remat_planning_work_on_the_fused_graph():
    model = tiny_lm("mamba2")
    ids, labels = batch()
    plain = mambac.compile(model, example_inputs=(ids, labels))
    mem = analyse(plain.program_for(ids, labels).gm)
    fused = next(n for n, op in mem.ops.items() if op == "linear_cross_entropy")
    assert mem.run.costs[fused].flops >= 2 * 24 * 32 * 40
    kept = sorted(s.nbytes for s in mem.storages.values() if fused in s.savers)
    assert kept == [4 * 24, 4 * 24 * 32]     # its per-token log-sum-exp and the hidden (B*L, D); no logits
    assert "remat='none'" in explain_memory(plain)
    budget = int(0.7 * mem.predict())
    compiled = mambac.compile(model, remat="auto", memory_budget=budget, example_inputs=(ids, labels))
    assert fused_count(compiled) == 1 and "(met;" in explain_memory(compiled)
    assert rel_err(compiled(ids, labels), model(ids, labels)) <= 1e-5


@pytest.mark.parametrize("spelling", ["flatten", "view"])
def test_hand_written_heads_fuse(spelling):
    model = Head(spelling=spelling, ignore_index=7)
    compiled = mambac.compile(model)
    assert fused_count(compiled) == 1 and ", 7)" in compiled.lowered_graph_text()
    x, labels = model.example_inputs()
    assert rel_err(compiled(x, labels), model(x, labels)) <= 1e-5


@pytest.mark.parametrize("kw", [dict(leak_logits=True), dict(bias=True), dict(label_smoothing=0.1),
                                dict(reduction="sum"), dict(weight=torch.rand(13))],
                         ids=["logits_returned", "bias", "label_smoothing", "sum", "class_weight"])
def test_does_not_fuse(kw):
    model = Head(**kw)
    compiled = mambac.compile(model)
    assert fused_count(compiled) == 0 and "F.cross_entropy" in compiled.lowered_graph_text()
    x, labels = model.example_inputs()
    out_c, out_e = compiled(x, labels), model(x, labels)
    for a, b in zip(out_c if kw.get("leak_logits") else (out_c,), out_e if kw.get("leak_logits") else (out_e,)):
        assert rel_err(a, b) <= 1e-5


def test_fp64_model_keeps_the_fp32_loss_dtype():
    model = tiny_lm("mamba2").double()
    ids, labels = batch()
    compiled = mambac.compile(model, example_inputs=(ids, labels))
    assert fused_count(compiled) == 1
    got, ref = compiled(ids, labels), model(ids, labels)
    assert got.dtype == ref.dtype == torch.float32 and rel_err(got, ref) <= 1e-6


def test_only_single_rank_pipelines_fuse_the_loss():
    one = pipeline_for(CompileOptions.create(world_size=1))
    assert one.index("fuse_ssm") < one.index("fuse_loss") < one.index("eliminate_dead_code")
    assert "fuse_loss" not in pipeline_for(CompileOptions.create(world_size=2, tp=2))
    assert linear_cross_entropy.__module__ == "mambac.ops.linear_cross_entropy"
