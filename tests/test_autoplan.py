"""The layout planner: known answers on analytical models (a long sequence needs cp, a large model
needs tp, a small one runs data-parallel, an impossible limit names the least memory), its memory
figures against the memory model, the table and the ``mambac plan`` command."""
from __future__ import annotations

import pytest

import mambac
from mambac.autoplan import (CPU, H200, ActBytes, Layout, ModelCost, candidates, evaluate, format_table,
                             measure, parse_bytes, plan, rank_layouts)
from mambac.cli import main
from mambac.errors import MambacOptionsError
from mambac.memory import analyse, human
from tests.models.tiny import tiny_lm

GiB = 2**30


def analytic(params: float, d_model: int = 1024, n_layer: int = 24, heads: int = 32) -> ModelCost:
    """A Mamba-2-like model by hand: per layer and token, ~6*d_model bf16 elements inside the mixer
    (tp-sharded) and 2*d_model fp32 on the residual stream; 2 FLOPs per parameter per token."""
    shard, rep = 12.0 * d_model * n_layer, 8.0 * d_model * n_layer
    return ModelCost(
        params=int(params), param_bytes=4, optimizer_bytes=8, n_layer=n_layer, d_model=d_model,
        act={"none": ActBytes((0, 0, 0, shard), (0, 0, 0, rep)),
             "full": ActBytes((0, 0, 0, 0), (0, 0, 0, rep))},
        flops_per_token=2 * params, io_bytes_per_token=4 * (shard + rep),
        recompute_flops_per_token={"none": 0.0, "full": 2 * params},
        state_bytes=2 * d_model * 128 * 4, halo_bytes=3 * 2 * d_model * 2, max_tp=heads)


def test_candidates_cover_every_factorisation():
    lays = candidates(8)
    assert all(c.tp * c.cp * c.dp == 8 for c in lays)
    assert {(c.tp, c.cp, c.dp) for c in lays} == {(t, c, 8 // (t * c)) for t in (1, 2, 4, 8) for c in (1, 2, 4, 8)
                                                  if 8 % (t * c) == 0}
    assert not any(c.sequence_parallel and c.tp == 1 for c in lays)
    assert len(lays) == len(set(lays))


def test_long_sequence_gets_context_parallelism():
    cost = analytic(130e6)
    seqlen = 1 << 18   # one sequence of 262k tokens: 48 GiB of residual stream even under full remat
    one = rank_layouts(cost, 1, 24 * GiB, 1, seqlen)
    assert not any(r.feasible for r in one)
    rows = plan(cost, world_size=4, device_memory=24 * GiB, batch=1, seqlen=seqlen)
    best = rows[0]
    assert best.feasible and best.layout.cp > 1, format_table(rows)
    assert all(r.layout.dp == 1 for r in rows if r.feasible)   # a batch of one cannot be split
    # sharding the sequence by tensor parallelism (sp) also fits, but moves B*L*d_model per layer
    tp_only = [r for r in rows if r.feasible and r.layout.cp == 1]
    assert tp_only and all(r.step_s > best.step_s for r in tp_only)


def test_large_model_gets_tensor_parallelism():
    cost = analytic(20e9, d_model=6144, n_layer=48, heads=96)   # 320 GB of weights, grads and Adam
    rows = plan(cost, world_size=4, device_memory=141e9, batch=4, seqlen=512)
    assert rows[0].layout.tp == 4, format_table(rows)
    assert all(r.layout.tp == 4 for r in rows if r.feasible)
    assert rows[0].weights == pytest.approx(20e9 * 16 / 4)


def test_small_model_prefers_data_parallelism():
    rows = plan(analytic(130e6), world_size=8, device_memory=80 * GiB, batch=16, seqlen=2048)
    best = rows[0].layout
    assert (best.tp, best.cp, best.dp, best.remat) == (1, 1, 8, "none"), format_table(rows)
    # on one device it fits too, with nothing to communicate
    one = plan(analytic(130e6), world_size=1, device_memory=80 * GiB, batch=2, seqlen=2048)
    assert one[0].layout == Layout() and one[0].comm_s == 0


def test_remat_chosen_only_when_needed():
    cost = analytic(130e6)
    roomy = plan(cost, world_size=1, device_memory=80 * GiB, batch=4, seqlen=4096)
    assert roomy[0].layout.remat == "none" and roomy[0].memory_budget is None
    assert "nothing to recompute" in {r.layout.remat: r for r in roomy if not r.feasible}["auto"].reason
    need = evaluate(cost, Layout(), 4, 4096, H200, 1e30).memory
    tight = plan(cost, world_size=1, device_memory=need * 0.7, batch=4, seqlen=4096)
    best = tight[0]
    # 'auto' keeps what fits and is charged only part of full remat's recompute
    assert best.layout.remat == "auto" and best.memory == pytest.approx(need * 0.7, rel=1e-6)
    assert best.memory_budget == int(need * 0.7 - best.weights)
    full = next(r for r in tight if r.layout.remat == "full")
    assert full.feasible and full.step_s > best.step_s > roomy[0].step_s
    assert "memory_budget=" in format_table(tight).splitlines()[2]


def test_impossible_limit_names_the_smallest_figure():
    cost = analytic(130e6)
    rows = rank_layouts(cost, 4, 1.0, 8, 2048)
    smallest = min(r.memory for r in rows)
    with pytest.raises(MambacOptionsError, match="smallest") as err:
        plan(cost, world_size=4, device_memory="1MiB", batch=8, seqlen=2048)
    assert human(smallest) in str(err.value)
    assert not any(r.feasible for r in rank_layouts(cost, 4, smallest * 0.999, 8, 2048))
    assert any(r.feasible for r in rank_layouts(cost, 4, smallest, 8, 2048))


def test_layouts_that_cannot_split_are_marked():
    rows = rank_layouts(analytic(130e6, heads=2), 4, 80 * GiB, 3, 1000)
    reasons = {r.layout: r.reason for r in rows}
    assert "batch 3" in reasons[Layout(1, 1, 4)]
    assert "seqlen 1000" in reasons[Layout(1, 4, 1)] or reasons[Layout(1, 4, 1)] == ""
    assert "heads" in reasons[Layout(4, 1, 1)]
    assert not any(r.feasible for r in rows if r.layout.dp in (2, 4))


@pytest.fixture(scope="module")
def tiny():
    model = tiny_lm("mamba2")
    return model, measure(model, example=(2, 16))


def test_measured_activations_match_the_memory_model(tiny):
    model, cost = tiny
    import torch
    from mambac.lowering import bind_inputs, lower
    from mambac.options import CompileOptions
    ids = torch.randint(0, 37, (4, 24))
    gm = lower(model, bind_inputs(model, (ids, ids), {}), CompileOptions.create()).gm
    exact = analyse(gm).predict()
    assert cost.act["none"].per_rank(4, 24, 1, False) == pytest.approx(exact, rel=1e-9)
    assert cost.act["full"].per_rank(4, 24, 1, False) < exact
    assert cost.params == sum(p.numel() for p in model.parameters())
    assert cost.recompute_flops_per_token["full"] > 0 and cost.max_tp == model.backbone.layers[0].mixer.nheads


def test_tiny_model_runs_data_parallel_and_shards_activations(tiny):
    model, cost = tiny
    rows = plan(cost, world_size=4, device_memory=80 * GiB, batch=8, seqlen=256)
    assert (rows[0].layout.dp, rows[0].layout.remat) == (4, "none")
    dp1 = evaluate(cost, Layout(cp=4), 8, 256, CPU, 1e30)
    sp = evaluate(cost, Layout(tp=4, sequence_parallel=True), 8, 256, CPU, 1e30)
    no_sp = evaluate(cost, Layout(tp=4), 8, 256, CPU, 1e30)
    assert sp.activations < no_sp.activations
    assert dp1.activations == pytest.approx(cost.act["none"].per_rank(8, 64, 1, False))


def test_package_export_and_table(tiny):
    _, cost = tiny
    import mambac.lowering, mambac.sharding_plan  # noqa: F401,E401  (importing submodules must not rebind mambac.plan)
    assert mambac.plan is plan and "plan" in mambac.__all__
    rows = mambac.plan(cost, world_size=2, device_memory=80 * GiB, batch=2, seqlen=64)
    text = format_table(rows)
    assert text.splitlines()[0].split()[:6] == ["#", "tp", "cp", "dp", "sp", "remat"]
    assert len(text.splitlines()) == 2 + sum(r.feasible for r in rows)
    assert len(format_table(rows, limit=None).splitlines()) == 2 + len(rows)


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GiB and parse_bytes("141 GB") == 141e9 and parse_bytes(5e9) == 5e9
    with pytest.raises(mambac.MambacInputError):
        parse_bytes("eighty gigs")


def test_cli_prints_the_table(capsys):
    assert main(["plan", "mamba2-tiny", "--world-size", "2", "--device-memory", "80GiB",
                 "--batch", "4", "--seqlen", "64"]) == 0
    out = capsys.readouterr().out
    assert "tp" in out.splitlines()[0] and "fits" in out
    assert main(["plan", "mamba2-tiny", "--world-size", "2", "--device-memory", "1KiB"]) == 2
    assert "smallest" in capsys.readouterr().err


# ---- mambac.compile(..., plan="auto") -----------------------------------------------------------

def _rows(cost, world, batch, seqlen):
    return rank_layouts(cost, world, 1e30, batch, seqlen, CPU)


def test_plan_auto_gives_tp_to_a_model_too_large_for_one_device(tiny, caplog):
    model, cost = tiny
    rows = _rows(cost, 2, 2, 8)
    weights_tp1 = min(r.weights for r in rows if r.layout.tp == 1)
    limit = int(0.8 * weights_tp1)   # weights, gradients and AdamW state alone overflow one device
    assert any(r.layout.tp == 2 and r.memory <= limit for r in rows)
    with caplog.at_level("INFO", logger="mambac.plan"):
        compiled = mambac.compile(model, world_size=2, plan="auto", device_memory=limit, batch=2, seqlen=8)
    opts = compiled.options
    assert opts.tp == 2 and opts.dp == 1 and opts.plan == ()
    assert (opts.device_memory, opts.batch, opts.seqlen) == (limit, 2, 8)
    assert "plan='auto'" in caplog.text and "tp=2" in caplog.text


def test_plan_auto_recomputes_when_memory_is_tight_and_meets_its_budget(tiny):
    import torch
    from mambac.memory import MEMORY_PLAN, measure_saved
    model, cost = tiny
    none, full = (evaluate(cost, Layout(remat=m), 4, 64, CPU, 1e30) for m in ("none", "full"))
    limit = int((none.memory + full.memory) / 2)
    ids, labels = torch.randint(0, 37, (4, 64)), torch.randint(0, 37, (4, 64))
    compiled = mambac.compile(model, plan="auto", device_memory=f"{limit}B", example_inputs=(ids, labels))
    opts = compiled.options
    assert (opts.remat, opts.batch, opts.seqlen, opts.world_size) == ("auto", 4, 64, 1)
    assert opts.memory_budget == int(limit - none.weights)
    plan_ = compiled.program_for(ids, labels).gm.meta[MEMORY_PLAN]
    got = measure_saved(compiled, ids, labels, exclude=[*model.parameters(), ids, labels]).nbytes
    assert plan_.regions and got <= opts.memory_budget < plan_.baseline
    assert abs(got - plan_.predicted) <= 0.1 * got


def test_plan_auto_picks_context_parallelism_for_a_batch_of_one(tiny):
    model, cost = tiny
    rows = plan(cost, world_size=2, device_memory=80 * GiB, batch=1, seqlen=64, device=CPU)
    assert rows[0].layout.cp == 2, format_table(rows)   # a batch of one: the sequence is what splits
    compiled = mambac.compile(model, world_size=2, plan="auto", device_memory=80 * GiB, batch=1, seqlen=64)
    assert (compiled.options.cp, compiled.options.tp) == (2, 1)


def test_plan_auto_skips_layouts_compile_cannot_run(tiny, monkeypatch, caplog):
    from mambac.options import CompileOptions
    model, cost = tiny
    rows = plan(cost, world_size=2, device_memory=80 * GiB, batch=1, seqlen=64, device=CPU)
    real = CompileOptions._validate

    def no_cp(self):
        if self.cp > 1:
            raise MambacOptionsError("cp is not available here")
        real(self)

    monkeypatch.setattr(CompileOptions, "_validate", no_cp)
    with caplog.at_level("INFO", logger="mambac.plan"):
        compiled = mambac.compile(model, world_size=2, plan="auto", device_memory=80 * GiB, batch=1, seqlen=64)
    best = next(r.layout for r in rows if r.feasible and r.layout.cp == 1)
    opts = compiled.options
    assert (opts.tp, opts.cp, opts.dp, opts.sequence_parallel, opts.remat) == (
        best.tp, best.cp, best.dp, best.sequence_parallel, best.remat)
    assert "skipped" in caplog.text


def test_plan_auto_errors_say_what_to_pass(tiny, monkeypatch):
    import torch
    from mambac.options import CompileOptions
    model, _ = tiny
    with pytest.raises(MambacOptionsError, match="plan='auto' chooses .*drop tp"):
        mambac.compile(model, plan="auto", tp=1, device_memory=GiB, batch=2, seqlen=8)
    with pytest.raises(MambacOptionsError, match="batch= and seqlen="):
        mambac.compile(model, plan="auto", device_memory=GiB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MambacOptionsError, match="device_memory="):
        mambac.compile(model, plan="auto", batch=2, seqlen=8)
    with pytest.raises(MambacOptionsError, match="plan='auto' only"):
        mambac.compile(model, batch=2)
    with pytest.raises(MambacOptionsError, match="needs the model"):
        CompileOptions.create(plan="auto")
    with pytest.raises(MambacOptionsError, match="smallest"):
        mambac.compile(model, plan="auto", device_memory="1KiB", batch=2, seqlen=8)
