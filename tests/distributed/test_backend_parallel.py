"""``torch.compile(model, backend="mambac", options={"world_size": W, ...})`` on 2 and 4 gloo ranks.

Tiny Mamba-2 and Mamba-3 LMs under tp (with and without sequence parallelism, with remat), cp and
tp x cp give the single-process eager logits, loss and gradient of every (full) parameter on every
rank (fp32, <= 1e-5 relative), at a second (dynamic) and a third length too, and stay equal after
an optimizer step; each rank's program holds only its shards.  Under cp a bare mixer's input
gradient is whole on every rank.  A world size the process group does not have and dp are clear
errors; a graph break and a compiled function that is not a module's forward run whole on every
rank, with a warning, and give eager's values and gradients."""
import pytest

from tests.distributed.backend_worker import DYNAMIC, WORLD2, WORLD4
from tests.distributed.harness import run_ranks

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def ranks(request):
    return request.param, run_ranks(request.param, "parity", module="tests.distributed.backend_worker", timeout=240)


def test_matches_single_process_eager_on_every_rank(ranks):
    world, results = ranks
    assert [res["rank"] for res in results] == list(range(world))
    for res in results:
        for name, (_, _, opts, lengths) in (WORLD2 if world == 2 else WORLD4).items():
            got = res[name]
            for what in ("logits", "loss", "grad", "after_step"):
                assert got[what] <= TOL, (world, res["rank"], name, what, got)
            assert got["replicated"] == 0, (name, got)   # split over the ranks, not run whole on each
            if name not in DYNAMIC:   # (dynamic=True: dynamo may trace a frame twice, its floats specialised)
                assert got["graphs"] == 2 * min(len(lengths), 2), (name, got)  # logits and loss; static, dynamic
            if "in_proj_rows" in got:  # tp splits in_proj: this rank's program holds its rows only
                local, full = got["in_proj_rows"]
                assert local < full, (name, got)
                assert ("plan_remat" in got["passes"]) == ("remat" in opts), (name, got["passes"])
                assert "propagate_sharding" in got["passes"]


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["w2"])
def test_mixer_input_gradient_is_whole_under_cp(ranks):
    _, results = ranks
    for res in results:
        assert max(res["mixer_cp2"].values()) <= TOL, res["mixer_cp2"]


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["w2"])
def test_clear_errors(ranks):
    _, results = ranks
    for res in (r["errors"] for r in results):
        assert res["mismatch"].startswith("MambacRuntimeError: options world_size=4 but the process group has 2 "
                                          "ranks; pass world_size=2"), res
        assert res["mismatch_by_name"].startswith("MambacRuntimeError: options world_size=3"), res
        assert res["dp"].startswith("MambacOptionsError: dp=2 is not supported by the torch.compile backend"), res
        assert "DistributedDataParallel" in res["dp"]


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["w2"])
def test_graphs_that_are_not_a_whole_forward_run_unsplit(ranks):
    _, results = ranks
    for res in (r["replicated"] for r in results):
        brk, fn = res["graph_break"], res["function"]
        assert brk["out"] <= TOL and brk["grad"] <= TOL and fn["out"] <= TOL and fn["grad"] <= TOL, res
        assert brk["replicated"] == 2 and fn["replicated"] == 1, res  # both pieces around the break; the lambda
        assert "dynamo broke the graph at " in brk["warning"] and "backend_worker.py" in brk["warning"], res
        assert "this graph comes from another function" in fn["warning"], res
