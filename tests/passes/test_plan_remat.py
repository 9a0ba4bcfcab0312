"""plan_remat: the printed graph after it, region counts, gradients bit-identical to no remat,
measured saved bytes within 10% of the prediction and under the budget, the errors, and the
regions of per-rank programs (tests/distributed/test_remat_parallel.py runs them on 2 ranks)."""
import re

import pytest
import torch
import torch.nn as nn

import mambac
from mambac.errors import MambacOptionsError
from mambac.memory import MEMORY_PLAN, measure_saved, op_name
from mambac.lowering import lower_all_ranks
from mambac.passes.plan_remat import RematRegion, communicates, make_plan
from mambac.runtime.collectives import collective_name
from tests.models.tiny import tiny_lm

FAMILIES = ["mamba1", "mamba2", "mamba3_siso"]


def batch(b=2, l=12, vocab=37):
    return torch.randint(0, vocab, (b, l)), torch.randint(0, vocab, (b, l))


def step(compiled, model, ids, labels):
    """Saved bytes of one forward (parameters and inputs excluded) and the parameter gradients."""
    got = measure_saved(compiled, ids, labels, exclude=[*model.parameters(), ids, labels])
    return got.nbytes, torch.autograd.grad(got.output, list(model.parameters()))


def plan_of(compiled, *inputs):
    return compiled.program_for(*inputs).gm.meta[MEMORY_PLAN]


def regions_of(compiled, ids, labels):
    gm = compiled.program_for(ids, labels).gm
    return {name: m for name, m in gm.named_children() if isinstance(m, RematRegion)}


def assert_same_grads(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", FAMILIES)
def test_full_recomputes_every_block(name):
    model, (ids, labels) = tiny_lm(name), batch()
    plain = mambac.compile(model, example_inputs=(ids, labels))
    full = mambac.compile(model, remat="full", example_inputs=(ids, labels))
    assert full.program_for(ids, labels).ctx.count("plan_remat", "regions") == 2
    text = full.lowered_graph_text()
    assert text.startswith("# mambac graph after 'plan_remat'")
    assert "= self.remat_backbone_layers_0(backbone_embedding)" in text
    assert "self.remat_backbone_layers_1(" in text and "mixer.in_proj" not in text  # blocks live in regions
    assert set(regions_of(full, ids, labels)) == {"remat_backbone_layers_0", "remat_backbone_layers_1"}
    base_bytes, base_grads = step(plain, model, ids, labels)
    got_bytes, got_grads = step(full, model, ids, labels)
    plan = plan_of(full, ids, labels)
    assert abs(plan.predicted - got_bytes) <= 0.1 * got_bytes and got_bytes < base_bytes / 2
    assert_same_grads(got_grads, base_grads)
    assert torch.equal(full(ids), plain(ids))


@pytest.mark.parametrize("name", FAMILIES)
def test_auto_meets_a_budget_between_the_least_and_no_remat(name):
    model, (ids, labels) = tiny_lm(name), batch()
    plain = mambac.compile(model, example_inputs=(ids, labels))
    free = make_plan(plain.program_for(ids, labels).gm, "auto", None)
    budget = (free.minimum + free.baseline) // 2
    auto = mambac.compile(model, remat="auto", memory_budget=budget, example_inputs=(ids, labels))
    plan = plan_of(auto, ids, labels)
    assert plan.regions and plan.predicted <= budget < plan.baseline
    got_bytes, got_grads = step(auto, model, ids, labels)
    assert abs(plan.predicted - got_bytes) <= 0.1 * got_bytes and got_bytes <= budget
    assert_same_grads(got_grads, step(plain, model, ids, labels)[1])


def test_auto_prefers_cheap_regions_over_recomputing_matmuls():
    model, (ids, labels) = tiny_lm("mamba2"), batch()
    plain = mambac.compile(model, example_inputs=(ids, labels))
    baseline = make_plan(plain.program_for(ids, labels).gm, "auto", None).baseline
    # 10 kB: more than the head's cross-entropy alone frees, less than one block's conv + scan + norm
    auto = mambac.compile(model, remat="auto", memory_budget=baseline - 10_000, example_inputs=(ids, labels))
    plan = plan_of(auto, ids, labels)
    assert [r.kind for r in plan.regions] == ["cheap"]
    bodies = [r.body.graph for r in regions_of(auto, ids, labels).values()]
    assert not any(n.op == "call_module" for g in bodies for n in g.nodes)  # no Linear is recomputed
    ops = {op_name(n) for g in bodies for n in g.nodes}
    assert {"mambac.ssd", "mambac.causal_conv1d", "mambac.gated_rmsnorm"} <= ops


def test_impossible_budget_names_the_least_feasible_one():
    model, (ids, labels) = tiny_lm("mamba2"), batch()
    with pytest.raises(MambacOptionsError, match=r"at least \d+") as info:
        mambac.compile(model, remat="auto", memory_budget=1000, example_inputs=(ids, labels))
    least = int(re.search(r"at least (\d+)", str(info.value)).group(1))
    assert "memory_budget=1000 bytes" in str(info.value)
    ok = mambac.compile(model, remat="auto", memory_budget=least, example_inputs=(ids, labels))
    assert plan_of(ok, ids, labels).predicted == least


def test_step_scope_counts_parameters_gradients_and_adamw_state():
    """memory_budget_scope='step': the budget covers the rank's parameters (fp32), their gradients,
    AdamW's two fp32 moments and the fused loss's backward workspace besides the activations, so a
    step budget of that much more gives the same plan as an activations budget; too small a step
    budget is a clear error."""
    from mambac.passes.plan_remat import loss_workspace_bytes, training_state_bytes
    model, (ids, labels) = tiny_lm("mamba2"), batch()
    plain = mambac.compile(model, example_inputs=(ids, labels))
    gm = plain.program_for(ids, labels).gm
    assert training_state_bytes(gm) == sum(p.numel() for p in model.parameters()) * (4 + 4 + 8)
    (vocab, d), tokens = model.lm_head.weight.shape, ids.numel()
    # the head's fp32 weight-gradient accumulator, one chunk's logits (all tokens here), d hidden
    assert loss_workspace_bytes(gm) == vocab * d * 4 + tokens * vocab * 4 + tokens * d * 4
    fixed = training_state_bytes(gm) + loss_workspace_bytes(gm)
    free = make_plan(gm, "auto", None)
    budget = (free.minimum + free.baseline) // 2
    acts = plan_of(mambac.compile(model, remat="auto", memory_budget=budget, example_inputs=(ids, labels)),
                   ids, labels)
    step_plan = plan_of(mambac.compile(model, remat="auto", memory_budget=budget + fixed,
                                       memory_budget_scope="step", example_inputs=(ids, labels)), ids, labels)
    assert [r.nodes for r in step_plan.regions] == [r.nodes for r in acts.regions]
    assert (step_plan.budget, step_plan.fixed) == (budget, fixed)
    with pytest.raises(MambacOptionsError, match="leaves nothing for activations"):
        mambac.compile(model, remat="auto", memory_budget=fixed, memory_budget_scope="step",
                       example_inputs=(ids, labels))
    with pytest.raises(MambacOptionsError, match=rf"at least {free.minimum + fixed}\b.*"):
        mambac.compile(model, remat="auto", memory_budget=fixed + 1000, memory_budget_scope="step",
                       example_inputs=(ids, labels))
    with pytest.raises(MambacOptionsError, match="memory_budget_scope"):
        mambac.compile(model, remat="auto", memory_budget=budget, memory_budget_scope="peak",
                       example_inputs=(ids, labels))


def test_step_scope_with_cuda_graphs_counts_the_static_gradient_buffers():
    """cuda_graphs=True keeps one static gradient buffer per trainable parameter in the graphs'
    pool beside .grad: the step scope takes those bytes off the budget too (CUDA graphs need a
    GPU to compile, so the pass's budget split is checked on the options alone)."""
    from types import SimpleNamespace

    from mambac.passes.plan_remat import activation_budget
    model, (ids, labels) = tiny_lm("mamba2"), batch()
    model.backbone.layers[0].norm.weight.requires_grad_(False)   # a frozen parameter has no gradient buffer
    gm = mambac.compile(model, example_inputs=(ids, labels)).program_for(ids, labels).gm
    trainable = sum(p.numel() * 4 for p in dict.fromkeys(model.parameters()) if p.requires_grad)
    budget = 1 << 30
    opts = dict(memory_budget=budget, memory_budget_scope="step")
    plain, fixed = activation_budget(gm, SimpleNamespace(cuda_graphs=False, **opts))
    graphed, fixed_graphed = activation_budget(gm, SimpleNamespace(cuda_graphs=True, **opts))
    assert fixed_graphed - fixed == trainable > 0
    assert plain - graphed == trainable
    with pytest.raises(MambacOptionsError, match="static gradient buffers"):
        activation_budget(gm, SimpleNamespace(cuda_graphs=True, memory_budget=fixed + 1, memory_budget_scope="step"))


def test_generous_budget_changes_nothing():
    model, (ids, labels) = tiny_lm("mamba2"), batch()
    plain = mambac.compile(model, example_inputs=(ids, labels))
    auto = mambac.compile(model, remat="auto", memory_budget=2 ** 40, example_inputs=(ids, labels))
    assert plan_of(auto, ids, labels).regions == ()
    body = lambda c: c.lowered_graph_text().split("\n", 1)[1]  # noqa: E731
    assert body(auto) == body(plain)


class Toy(nn.Module):
    """Two linears around cheap elementwise math: the math is what 'auto' recomputes."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.lin1(x)
        return self.lin2(torch.tanh(h * torch.sigmoid(h)))

    def example_inputs(self):
        return (torch.randn(2, 5, 8),)


def test_small_graph_printed_after_plan_remat():
    model = Toy()
    compiled = mambac.compile(model, remat="auto")
    assert compiled.lowered_graph_text() == """\
# mambac graph after 'plan_remat' (rank 0 of 1)
def forward(self):
    x = input()  # f32[2, 5, 8]
    lin1 = self.lin1(x)  # f32[2, 5, 16] | lin1
    remat_body_run0 = self.remat_body_run0(lin1)  # (f32[2, 5, 16])
    getitem = operator.getitem(remat_body_run0, 0)  # f32[2, 5, 16]
    lin2 = self.lin2(getitem)  # f32[2, 5, 8] | lin2
    return lin2
"""
    body = compiled.program_for(*model.example_inputs()).gm.remat_body_run0.body
    assert [n.op for n in body.graph.nodes] == ["placeholder"] + ["call_function"] * 3 + ["output"]
    x = model.example_inputs()[0]
    plan = plan_of(compiled, x)
    assert plan.baseline - plan.predicted == 2 * 5 * 16 * 4  # sigmoid(h) is no longer kept
    got = measure_saved(compiled, x, exclude=[*model.parameters(), x])
    assert got.nbytes == plan.predicted
    g_remat = torch.autograd.grad(got.output.sum(), list(model.parameters()))
    assert_same_grads(g_remat, torch.autograd.grad(model(x).sum(), list(model.parameters())))


def test_dump_shows_the_regions(tmp_path):
    mambac.compile(tiny_lm("mamba1"), remat="full", dump_dir=str(tmp_path))
    files = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert files[-1] == "05_plan_remat.txt"
    assert "self.remat_backbone_layers_1(" in (tmp_path / "rank0" / files[-1]).read_text()


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_rank_programs_keep_forward_collectives_outside_regions(sp):
    """Offline (no process group): each rank's program is planned with its local shapes; blocks are
    split at the collectives that communicate forward, which stay in the outer graph, each once."""
    model, (ids, labels) = tiny_lm("mamba1"), batch()
    ranks = lower_all_ranks(model, (ids, labels), 2, remat="full", sequence_parallel=sp)
    plain = lower_all_ranks(model, (ids, labels), 2, sequence_parallel=sp)[0].gm
    gm = ranks[0].gm
    comms = lambda g: [collective_name(n) for n in g.graph.nodes if communicates(n)]  # noqa: E731
    bodies = [m.body for m in gm.modules() if isinstance(m, RematRegion)]
    assert bodies and not any(comms(b) for b in bodies)
    assert comms(gm) == comms(plain) and comms(gm)
    assert "self.remat_backbone_layers_0_part1(" in ranks[1].ctx.history[-1][1]
    plan = gm.meta[MEMORY_PLAN]
    single = make_plan(mambac.compile(model, example_inputs=(ids, labels)).program_for(ids, labels).gm, "none", None)
    assert plan.baseline < single.baseline   # the rank's sharded activations, not the whole model's



def test_region_values_come_from_its_nodes_not_from_running_the_wrapper(monkeypatch):
    """Inserting a region does not evaluate the checkpoint wrapper on fake tensors (torch 2.11 under
    CUDA autocast could not); the call and its reads carry the values the moved nodes had."""
    def refuse(self, *args):
        raise AssertionError("RematRegion evaluated while it was inserted")

    model, (ids, labels) = tiny_lm("mamba2"), batch()
    plain = mambac.compile(model, example_inputs=(ids, labels)).program_for(ids, labels).gm
    monkeypatch.setattr(RematRegion, "forward", refuse)
    gm = mambac.compile(model, remat="full", example_inputs=(ids, labels)).program_for(ids, labels).gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("remat_")]
    assert len(calls) == 2
    for call in calls:
        assert isinstance(call.meta["val"], tuple) and len(call.users) == len(call.meta["val"])
        for read in call.users:
            assert read.meta["val"] is call.meta["val"][read.args[1]]
            assert isinstance(read.meta["val"], torch.Tensor)

    def out_shape(g):
        return tuple(next(iter(g.graph.find_nodes(op="output"))).args[0].meta["val"].shape)
    assert out_shape(gm) == out_shape(plain)


class _DropoutBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.lin(x)))


class _DropoutStack(nn.Module):
    def __init__(self, d: int = 8, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DropoutBlock(d) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_replay_keeps_the_random_state_only_where_a_region_draws_random_numbers():
    """A region with dropout saves and restores the generators' state, so its replay draws the same
    mask (gradients equal those without remat, same seed); Mamba blocks draw nothing and skip that
    (host time per region, and a CUDA graph capture cannot read a CUDA generator's state)."""
    model, (ids, labels) = tiny_lm("mamba2"), batch()
    full = mambac.compile(model, remat="full", example_inputs=(ids, labels))
    assert not any(r.random for r in regions_of(full, ids, labels).values())

    stack = _DropoutStack().train()
    x = torch.randn(3, 5, 8)
    plain = mambac.compile(stack, example_inputs=(x,))
    remat = mambac.compile(stack, remat="full", example_inputs=(x,))
    regions = [m for m in remat.program_for(x).gm.children() if isinstance(m, RematRegion)]
    assert len(regions) == 2 and all(r.random for r in regions)
    grads = []
    for compiled in (plain, remat):
        torch.manual_seed(7)
        grads.append(torch.autograd.grad(compiled(x), list(stack.parameters())))
    assert_same_grads(grads[1], grads[0])
