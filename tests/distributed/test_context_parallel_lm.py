"""Context parallelism through ``mambac.compile`` on 2 and 4 gloo ranks: Mamba-1, Mamba-2 and Mamba-3
LMs under cp, tp x cp (with and without sequence parallelism) and dp x cp give the single-process
eager logits, loss, parameter gradients and state dict (fp32, <= 1e-5 relative) at lengths that are
and are not multiples of cp x chunk, with whole or per-rank inputs; at a long sequence each rank saves
about 1/cp of the single-process activations."""
import pytest

from tests.distributed.cp_lm_worker import KERNELS2, KERNELS4, WORLD2, WORLD4
from tests.distributed.harness import run_ranks

TOL = 1e-5


@pytest.fixture(scope="module", params=[2, 4], ids=["w2", "w4"])
def ranks(request):
    return request.param, run_ranks(request.param, "cp_lm", timeout=300)


def _keys(table):
    return [f"{name}@{L}" for name, (_, _, lengths) in table.items() for L in lengths]


def test_matches_single_process_eager(ranks):
    world, results = ranks
    for res in results:
        for key in _keys(WORLD2 if world == 2 else WORLD4):
            got = res[key]
            assert got["keys_match"], key
            for what in ("logits", "loss", "grad", "state_dict"):
                assert got[what] <= TOL, (world, res["rank"], key, what, got)


def test_saved_activations_per_rank_are_about_one_over_cp(ranks):
    """8192 tokens: each rank saves about 1/cp of the single-process activations, and the loss and
    parameter gradients still equal eager."""
    world, results = ranks
    for res in results:
        long = res["long"]
        assert long["loss"] <= TOL and long["grad"] <= TOL, long
        ratio = long["rank_bytes"] / long["single_bytes"]
        assert 0.8 / world <= ratio <= 1.2 / world, long  # 1/cp, plus the small per-rank summaries


@pytest.mark.parametrize("ranks", [2], indirect=True, ids=["w2"])
def test_sharded_output_is_this_ranks_piece_of_the_sequence(ranks):
    _, results = ranks
    assert all(res["sharded_output"] <= TOL for res in results)


@pytest.mark.parametrize("world", [2, 4])
def test_generated_kernels_with_the_fused_cp_ssd_match_single_process_eager(world, tmp_path):
    """kernels="triton" under the interpreter: cp_ssd runs its fused form (exchange inside the
    autograd Function), alone (cp=2) and under tp x cp (2 x 2), and the LM still equals eager."""
    env = {"TRITON_INTERPRET": "1", "MAMBAC_CACHE_DIR": str(tmp_path)}
    results = run_ranks(world, "cp_lm_kernels", timeout=300, env=env)
    for res in results:
        assert res["fused_calls"] > 0, res
        for key in _keys(KERNELS2 if world == 2 else KERNELS4):
            got = res[key]
            for what in ("logits", "loss", "grad", "state_dict"):
                assert got[what] <= TOL, (world, res["rank"], key, what, got)
