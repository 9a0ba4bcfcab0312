"""Four gloo ranks: uneven head and sequence splits at tp=4, dp x tp with DDP, resharding a
torch.distributed.checkpoint from tp=4 to dp=2 x tp=2, and three AdamW steps with gradient
clipping that match three single-device steps (one scenario, one process group)."""
import pytest

from tests.distributed.harness import run_ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    return run_ranks(4, "w4", timeout=300, env={"MAMBAC_TEST_TMP": str(tmp_path_factory.mktemp("dcp"))})


@pytest.mark.parametrize("name", ["oddheads_tp4", "mamba1_tp4_sp", "mamba2_dp2_tp2_sp"])
def test_matches_eager(w4, name):
    for r in w4:
        res = r[name]
        assert res["keys_match"]
        assert max(res["logits"], res["loss"], res["grad"], res["state_dict"]) <= TOL, res


def test_uneven_heads_keep_one_out_proj_reduce(w4):
    # 6 heads over 4 ranks (2, 2, 1, 1): one all-reduce after out_proj, one for the straddling norm group
    assert w4[0]["oddheads_tp4"]["counts"]["all_reduce"] == 2


def test_checkpoint_reshards(w4):
    assert all(r["reshard"] == 0.0 for r in w4)


def test_three_adamw_steps_match_single_device(w4):
    for r in w4:
        assert r["training"]["params"] <= TOL
        assert max(r["training"]["norms"]) <= 1e-5       # clip_grad_norm_ saw the unsharded norm
        assert min(r["training"]["norm_values"]) > 0.5   # so clipping was active
