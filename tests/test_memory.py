"""The memory model against what autograd really saves (saved-tensor hooks on the CPU), its
formulas in B and L, node costs, the report, and the remat benchmark's --tiny mode."""
import importlib.util
import sys
from pathlib import Path

import pytest
import sympy
import torch

import mambac
from mambac.memory import B, L, MEMORY_PLAN, analyse, explain_memory, measure_saved, memory_table
from tests.models.tiny import tiny_lm

FAMILIES = ["mamba1", "mamba2", "mamba3_siso"]
SIZES = {"small": (dict(), (2, 12)), "larger": (dict(d_model=48, n_layer=3), (3, 20))}
ROOT = Path(__file__).resolve().parents[1]


def batch(b, l, vocab=37):
    return torch.randint(0, vocab, (b, l)), torch.randint(0, vocab, (b, l))


def measured(compiled, model, *inputs):
    """Bytes of the distinct storages autograd saves in one forward (parameters and inputs excluded)."""
    return measure_saved(compiled, *inputs, exclude=[*model.parameters(), *inputs]).nbytes


def close(predicted, real, tol=0.10):
    return abs(predicted - real) <= tol * real


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("name", FAMILIES)
def test_prediction_matches_saved_tensor_hooks(name, size):
    over, (b, l) = SIZES[size]
    model = tiny_lm(name, **over)
    ids, labels = batch(b, l)
    compiled = mambac.compile(model, example_inputs=(ids, labels))
    predicted = analyse(compiled.program_for(ids, labels).gm).predict()
    real = measured(compiled, model, ids, labels)
    assert close(predicted, real), (predicted, real)


@pytest.mark.parametrize("name", FAMILIES)
def test_prediction_matches_in_bf16(name):
    """A bf16 model (fp32 residual stream): the dtypes of what is saved are predicted too."""
    model = tiny_lm(name, d_model=48).to(torch.bfloat16)
    ids, labels = batch(3, 20)
    compiled = mambac.compile(model, example_inputs=(ids, labels))
    predicted = analyse(compiled.program_for(ids, labels).gm).predict()
    assert close(predicted, measured(compiled, model, ids, labels), tol=0.01)


@pytest.mark.parametrize("name", FAMILIES)
def test_formulas_in_B_and_L_predict_other_shapes(name):
    model = tiny_lm(name)
    compiled = mambac.compile(model, example_inputs=batch(2, 12))
    mem = analyse(next(iter(compiled.programs.values())).gm)
    total = mem.total_formula(mem.kept())
    assert total.free_symbols == {B, L}
    for b, l in [(2, 7), (5, 30)]:  # the same program runs at other shapes (B = 1 lets more reshapes be views)
        ids, labels = batch(b, l)
        real = measured(compiled, model, ids, labels)
        assert close(int(total.subs({B: b, L: l})), real), (b, l, total, real)


def test_known_terms_of_the_formulas():
    model = tiny_lm("mamba2")
    compiled = mambac.compile(model, example_inputs=batch(2, 12))
    mem = analyse(next(iter(compiled.programs.values())).gm)
    d_model, d_in_proj = 32, model.backbone.layers[0].mixer.in_proj.out_features
    assert mem.formula("add_rmsnorm_1[1]") == 4 * B * L * d_model        # the fp32 residual stream
    assert mem.formula("backbone_layers_0_mixer_in_proj") == 4 * B * L * d_in_proj
    assert mem.storages["backbone_layers_0_mixer_in_proj"].savers == ("causal_conv1d", "gated_rmsnorm", "ssd")


def test_costs_follow_the_shapes():
    model = tiny_lm("mamba2")
    compiled = mambac.compile(model, example_inputs=batch(2, 12))
    mem = analyse(next(iter(compiled.programs.values())).gm)
    lin = model.backbone.layers[0].mixer.in_proj
    assert mem.run.costs["backbone_layers_0_mixer_in_proj"].flops == 2 * (2 * 12) * lin.in_features * lin.out_features
    assert mem.formula("flops:backbone_layers_0_mixer_in_proj") == 2 * B * L * lin.in_features * lin.out_features
    ssd = mem.formula("flops:ssd")
    assert sympy.Poly(ssd, B, L).degree(B) == 1 and sympy.Poly(ssd, B, L).degree(L) == 1  # chunked: linear in L
    assert mem.run.costs["getitem"].flops == 0 and mem.run.costs["getitem"].io_bytes == 0  # views are free


def test_measure_saved_counts_each_storage_once():
    x = torch.randn(4, 6, requires_grad=True)

    def f(x):
        a = x * 2                                   # saves nothing (scalar factor)
        return (a.view(-1) ** 2).sum() + (a.t() ** 2).sum()   # two views of one storage are saved

    got = measure_saved(f, x, exclude=[x])
    assert (got.nbytes, got.count) == (4 * 6 * 4, 1)
    assert measure_saved(lambda x: (x.sin() * x.cos()).sum(), x).count == 3  # x, sin(x), cos(x)


def test_explain_memory_and_table_agree_with_the_plan():
    model = tiny_lm("mamba2")
    ids, labels = batch(2, 12)
    plain = mambac.compile(model, example_inputs=(ids, labels))
    baseline = analyse(plain.program_for(ids, labels).gm).predict()
    compiled = mambac.compile(model, remat="auto", memory_budget=int(0.7 * baseline), example_inputs=(ids, labels))
    plan = compiled.program_for(ids, labels).gm.meta[MEMORY_PLAN]
    text = explain_memory(compiled)
    assert "remat='auto'" in text and "budget" in text and "(met;" in text and "B*L" in text
    assert all(r.name in text for r in plan.regions) and plan.regions
    rows = memory_table(compiled)
    assert sum(r.kept_bytes for r in rows) == plan.predicted <= plan.budget
    assert sum(r.saved_bytes for r in rows) == plan.baseline == baseline
    assert {r.region for r in rows if r.region} == {r.name for r in plan.regions}
    report = explain_memory(plain)  # a program planned without remat is analysed on demand
    assert "remat='none'" in report and "0 regions" in report


def _bench_remat():
    spec = importlib.util.spec_from_file_location("bench_remat", ROOT / "benchmarks" / "bench_remat.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_remat"] = bench
    spec.loader.exec_module(bench)
    return bench


def test_bench_remat_verdict_takes_the_allocated_peak_and_names_the_reserved_one():
    """The goal's peak is torch.cuda.max_memory_allocated (as ANCHORS measures peaks); the memory
    reserved is reported beside it, not judged."""
    bench, gib = _bench_remat(), 2 ** 30
    none = bench.Row(mode="none", peak=int(9.7 * gib), reserved=int(11.4 * gib), tokens_per_s=100.0, ratio=1.0)
    auto = bench.Row(mode="auto", budget=8 * gib, peak=int(6.5 * gib), reserved=int(8.25 * gib),
                     tokens_per_s=91.0, ratio=0.91)
    text = bench.verdict([none, auto], 8 * gib)
    assert text.startswith("goal MET") and "reserved 8.25 GiB" in text and "max_memory_allocated" in text
    slow = bench.Row(mode="auto", budget=8 * gib, peak=int(6.5 * gib), reserved=gib, tokens_per_s=70.0, ratio=0.7)
    big = bench.Row(mode="auto", budget=8 * gib, peak=int(8.1 * gib), reserved=gib, tokens_per_s=90.0, ratio=0.9)
    assert bench.verdict([none, slow], 8 * gib).startswith("goal NOT met")
    assert bench.verdict([none, big], 8 * gib).startswith("goal NOT met")


def test_bench_remat_tiny_runs(capsys):
    bench = _bench_remat()
    rows = bench.main(["--tiny"])
    out = capsys.readouterr().out
    assert [r.mode for r in rows] == ["none", "full", "auto"] and not any(r.error for r in rows)
    for r in rows:
        assert close(r.predicted, r.measured) and r.tokens_per_s > 0
    none, full, auto = rows
    assert full.measured < auto.measured <= auto.budget < none.measured
    assert "predicted saved" in out and "tokens/s" in out and "auto" in out
