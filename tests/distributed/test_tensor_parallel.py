"""Tensor and sequence parallelism on 2 gloo ranks: every family's logits, loss, gradients and
unsharded state dict equal the single-process eager model (fp32, <= 1e-5 relative), and the
lowered programs hold the expected collectives per mixer (one scenario, one process group)."""
import pytest

from tests.distributed.harness import run_ranks
from tests.distributed.worker import TP2, TP2_SP

TOL = 1e-5


@pytest.fixture(scope="module")
def tp2():
    return run_ranks(2, "tp2", timeout=240)


def _numerics_ok(res: dict) -> None:
    assert res["keys_match"]
    for key in ("logits", "loss", "grad", "state_dict"):
        assert res[key] <= TOL, (key, res)


@pytest.mark.parametrize("name", [n for n in TP2] + [n + "+sp" for n in TP2_SP])
def test_matches_eager_on_every_rank(tp2, name):
    for rank_result in tp2:
        _numerics_ok(rank_result[name])


def test_mamba2_one_all_reduce_per_mixer(tp2):
    # ngroups divisible by tp: in_proj needs nothing forward, out_proj one all-reduce
    assert tp2[0]["mamba2_groups"]["counts"] == {"all_reduce": 1, "grad_all_reduce": 1}
    # ngroups=1: B/C replicated (their gradients summed), and the gated norm's single group
    # straddles the ranks: one more all-reduce of the per-group sums of squares (b, l, 1)
    assert tp2[0]["mamba2"]["counts"]["all_reduce"] == 2


def test_mamba1_all_reduces_x_proj_and_out_proj(tp2):
    assert tp2[0]["mamba1"]["counts"]["all_reduce"] == 2


def test_sequence_parallel_one_gather_one_reduce_scatter_per_mixer(tp2):
    for name in ("mamba2_groups+sp", "mamba2_groups_hdimD_nonorm_limit+sp"):
        assert tp2[0][name]["counts"] == {"all_gather_rs": 1, "reduce_scatter": 1}
    counts = tp2[0]["mamba1+sp"]["counts"]
    assert (counts["all_gather_rs"], counts["reduce_scatter"], counts["all_reduce"]) == (1, 1, 1)


def test_plan_override_replicates_a_mixer(tp2):
    _numerics_ok(tp2[0]["override"])
    assert tp2[0]["override"]["counts"] == {}


def test_data_parallel_alone(tp2):
    _numerics_ok(tp2[0]["dp_only"])  # the batch of 3 split 2 + 1, DDP sums the gradients
    assert tp2[0]["dp_only"]["counts"] == {}


def test_sharded_output_is_this_ranks_vocab_slice(tp2):
    assert [r["sharded_width"] for r in tp2] == [20, 20]
    assert all(r["sharded_output"] <= TOL for r in tp2)


def test_unsharded_state_dict_loads(tp2):
    assert all(r["reload"] <= TOL for r in tp2)


def test_world_size_must_match_the_process_group(tp2):
    assert "process group has 2 ranks" in tp2[0]["wrong_world"]


def test_bf16_models_on_two_ranks(tp2):
    """bf16 models (fp32 residual stream) under tp, tp + sp and cp: logits and gradients as close
    to the float64 model as single-process eager bf16 is."""
    for rank_result in tp2:
        found = {k: v for k, v in rank_result.items() if k.startswith("bf16 ")}
        assert len(found) == 3, sorted(rank_result)
        for key, res in found.items():
            assert res["dtype"] == "torch.bfloat16", key
            assert res["logits"] <= 2 * res["logits_eager"] + 1e-3, (key, res)
            assert res["grad"] <= 2 * res["grad_eager"] + 1e-2, (key, res)


def test_a_module_of_several_ranks_is_not_pickled(tp2):
    for rank_result in tp2:
        assert "cannot be pickled" in rank_result["pickle"] and "state_dict" in rank_result["pickle"]


@pytest.mark.parametrize("layout", ["dp", "tp+sp"])
def test_plain_torch_layers_around_the_mixers(tp2, layout):
    """LayerNorm, GELU, Dropout, Conv1d, GroupNorm and LogSoftmax modules keep the batch split
    under dp (each sample is computed alone) and run whole under tp: output and every gradient
    equal eager."""
    for rank_result in tp2:
        res = rank_result["torch_layers " + layout]
        assert res["logits"] <= TOL and res["grad"] <= TOL, res
