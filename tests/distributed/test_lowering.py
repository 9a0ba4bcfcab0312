"""Per-rank lowering without any process group: plans, local shapes, collectives per layer, dumps
of every rank, and the errors that say how to launch."""
import pytest
import torch

import mambac
from mambac.errors import MambacConfigError, MambacOptionsError, MambacRuntimeError
from mambac.ir import Replicate, Shard
from mambac.lowering import lower_all_ranks
from mambac.sharding_plan import local_model, make_plan
from mambac.runtime.collectives import collective_name, split_sizes
from tests.models.tiny import tiny_lm


def _counts(lowered, prefix="backbone.layers.0.mixer"):
    out = {}
    for node in lowered.gm.graph.nodes:
        name = collective_name(node)
        if name and node.meta["mambac_source"].module_path.startswith(prefix):
            out[name] = out.get(name, 0) + 1
    return out


def test_uneven_split_first_ranks_take_more():
    assert split_sizes(6, 4) == [2, 2, 1, 1] and split_sizes(8, 4) == [2, 2, 2, 2] and split_sizes(3, 2) == [2, 1]


def test_mamba2_in_proj_is_split_by_segment():
    model = tiny_lm("mamba2_oddheads_normbeforegate_mlp", n_layer=1)  # 6 heads of 8, ngroups=1
    plan = make_plan(model, tp=4, tp_rank=2)
    rows = plan.layout_of("backbone.layers.0.mixer.in_proj.weight").segments
    got = {s.name: (s.start, s.size, s.total) for s in rows if s.size}
    assert got == {"z": (32, 8, 48), "x": (32, 8, 48), "B": (0, 8, 8), "C": (0, 8, 8), "dt": (4, 1, 6)}
    local = local_model(model, plan)
    mixer = local.backbone.layers[0].mixer
    assert (mixer.nheads, mixer.ngroups, mixer.d_ssm) == (1, 1, 8)
    assert mixer.in_proj.weight.shape == (8 + 8 + 16 + 1, 24) and mixer.norm.group_size == 48
    assert mixer.out_proj.weight.shape == (24, 8)
    full = model.backbone.layers[0].mixer.in_proj.weight
    assert torch.equal(mixer.in_proj.weight[:8], full[32:40])             # its head's z rows
    assert torch.equal(mixer.in_proj.weight[8:16], full[48 + 32:48 + 40])  # its head's x rows
    assert local.lm_head.weight is local.backbone.embedding.weight       # still tied


def test_every_rank_program_has_local_shapes_and_placements():
    model = tiny_lm("mamba2", n_layer=1, ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4, ngroups=2))
    ids = torch.randint(0, 37, (2, 8))
    progs = lower_all_ranks(model, (ids,), 2)
    assert [p.ctx.rank for p in progs] == [0, 1]
    text = progs[1].ctx.history[-1][1]
    assert text.startswith("# mambac graph after 'eliminate_dead_code' (rank 1 of 2)")
    assert "tp=S(2)[x:4+4/8]" in text and "tp=P" in text and "mambac.all_reduce" in text
    ssd = next(n for n in progs[0].gm.graph.nodes if "ssd" in str(n.target))
    assert tuple(ssd.meta["val"][0].shape) == (2, 8, 4, 8)  # 4 of the 8 heads
    assert _counts(progs[0]) == {"all_reduce": 1, "grad_all_reduce": 1}


def test_sequence_parallel_program():
    model = tiny_lm("mamba1", n_layer=1)
    progs = lower_all_ranks(model, (torch.randint(0, 37, (2, 9)),), 2, sequence_parallel=True)
    counts = _counts(progs[1])
    assert (counts["all_gather_rs"], counts["reduce_scatter"], counts["all_reduce"]) == (1, 1, 1)
    norm = next(n for n in progs[1].gm.graph.nodes if "add_rmsnorm" in str(n.target))
    assert tuple(norm.meta["val"][0].shape) == (2, 4, 32)  # rank 1 holds 4 of the 9 positions
    assert isinstance(norm.meta["mambac_placement"].items[0].on("tp"), Shard)
    assert progs[1].ctx.count("cancel_redundant_comms", "gather_grad_fused") == 2


def test_running_without_a_process_group_says_how_to_launch(tmp_path):
    model = tiny_lm("mamba1", n_layer=1)
    compiled = mambac.compile(model, world_size=2, dump_dir=str(tmp_path))
    ids = torch.randint(0, 37, (1, 4))
    with pytest.raises(MambacRuntimeError, match="mambac run -n 2"):
        compiled(ids)
    lowered = compiled.program_for_rank(1, ids)
    assert lowered.ctx.rank == 1 and (tmp_path / "rank1").is_dir()
    assert compiled.backbone.embedding.weight.shape == (20, 32)  # rank 0's vocabulary half


def test_plan_errors():
    model = tiny_lm("mamba2", n_layer=1)  # 8 heads
    with pytest.raises(MambacConfigError, match="fewer than tp=16"):
        make_plan(model, tp=16, tp_rank=0)
    with pytest.raises(MambacOptionsError, match="does not have"):
        make_plan(model, tp=2, tp_rank=0, overrides={"backbone.nothing": "replicate"})
    with pytest.raises(MambacOptionsError, match="them differently"):
        make_plan(model, tp=2, tp_rank=0, overrides={"backbone.embedding": "replicate"})  # tied to lm_head


def test_options_for_several_ranks():
    opts = mambac.CompileOptions.create(world_size=4, dp=2, sequence_parallel=True, plan={"lm_head": "replicate"})
    assert (opts.tp, opts.dp, opts.plan) == (2, 2, (("lm_head", "replicate"),))
    assert mambac.CompileOptions.create(world_size=4, cp=2).tp == 2   # tp fills what dp x cp leave
    with pytest.raises(MambacOptionsError, match="cp_inputs must be one of"):
        mambac.CompileOptions.create(world_size=2, cp=2, cp_inputs="mine")
    with pytest.raises(MambacOptionsError, match="does not multiply"):
        mambac.CompileOptions.create(world_size=4, tp=4, cp=2)
    with pytest.raises(MambacOptionsError, match="comm_timeout"):
        mambac.CompileOptions.create(world_size=2, comm_timeout=-1)


def _placement(lowered, target: str, mesh_dim: str):
    node = next(n for n in lowered.gm.graph.nodes if n.op == "call_module" and n.target == target)
    return node.meta["mambac_placement"].on(mesh_dim)


def test_per_sample_torch_modules_keep_the_batch_split_under_dp():
    from tests.distributed.worker import TorchLayersNet
    x = torch.randn(4, 12, 5)
    prog = lower_all_ranks(TorchLayersNet(), (x,), 2, dp=2)[1]
    for target in ("conv", "norm", "act", "drop", "gn", "sm"):
        assert _placement(prog, target, "dp") == Shard(0), target
    tp = lower_all_ranks(TorchLayersNet(), (x,), 2, tp=2)[1]
    for target in ("norm", "gn"):   # whole on the tp dim: their parameters' gradients stay whole
        assert not isinstance(_placement(tp, target, "tp"), Shard), target


def test_unknown_modules_refuse_a_split_and_known_ones_gather_what_they_need():
    class BatchMixing(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.out = torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)

        def forward(self, x):
            return self.out(self.bn(x.transpose(1, 2)).transpose(1, 2))

    class NormOverBatch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.sm = torch.nn.LayerNorm((4, 6, 5)), torch.nn.Softmax(0)

        def forward(self, x):
            return self.sm(self.norm(x))

    x = torch.randn(4, 6, 5)
    with pytest.raises(mambac.MambacError, match="module BatchNorm1d has no sharding rule"):
        lower_all_ranks(BatchMixing(), (x,), 2, dp=2)
    # normalises (and the softmax runs) over the batch: both take the whole batch, which every rank has
    prog = lower_all_ranks(NormOverBatch(), (x,), 2, dp=2)[0]
    assert _placement(prog, "norm", "dp") == Replicate() and _placement(prog, "sm", "dp") == Replicate()
    assert not [n for n in prog.gm.graph.nodes if collective_name(n)]
