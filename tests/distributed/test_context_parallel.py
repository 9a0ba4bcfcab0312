"""Context parallelism on 2 and 4 gloo ranks: the conv halo exchange and the state passing of the
Mamba-1, Mamba-2 and Mamba-3 (SISO, MIMO) scans give each rank its piece of the single-process
output, the input gradients summed over the ranks equal the single-process ones, and the last
rank's final states are the sequence's (fp32, <= 1e-5 relative), at lengths that are and are not
multiples of ranks x chunk; with bf16 inputs the summaries they exchange are fp32; and SSD's
generated-kernel form (``cp_ssd`` with kernels="triton" under the
Triton interpreter) the same way."""
import pytest

from tests.distributed.harness import run_ranks

TOL = 1e-5
OPS = ("conv", "selective_scan", "ssd", "mamba3_siso", "mamba3_mimo")


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def ranks(request):
    return request.param, run_ranks(request.param, "cp", timeout=90)


@pytest.mark.parametrize("op", OPS)
def test_matches_single_process(ranks, op):
    world, results = ranks
    lengths = (8, 11) if world == 2 else (16, 9)
    for r, res in enumerate(results):
        for L in lengths:
            got = res[f"{op}/{L}"]
            assert max(got["out"], got["grad"], got["final"]) <= TOL, (world, r, L, got)


@pytest.mark.parametrize("op", ("selective_scan", "ssd", "mamba3_siso", "mamba3_mimo"))
def test_bf16_inputs_exchange_fp32_summaries(ranks, op):
    """bf16 inputs, 128 tokens per rank with per-step log-decays near -0.005: the summaries each rank
    sends are fp32 and equal, to fp32 precision, those of the same values in float64 (decays summed
    in bf16 would be off by about 2e-3), and the output pieces match the float64 whole-sequence op
    within bf16 rounding."""
    world, results = ranks
    for r, res in enumerate(results):
        got = res[f"{op}/bf16"]
        assert got["dtype"] == "torch.bfloat16" and got["summaries"] == "torch.float32", (world, r, got)
        assert got["summary_err"] <= 1e-5, (world, r, got)
        assert got["out"] <= 3e-2, (world, r, got)


@pytest.mark.parametrize("world", [2, 4])
def test_ssd_on_generated_kernels_matches_single_process(world, tmp_path):
    """``cp_ssd`` with kernels="triton" under the interpreter: the generated-kernel form with the
    exchange inside one autograd Function (``cp_ssd_fused``) on real gloo ranks."""
    env = {"TRITON_INTERPRET": "1", "MAMBAC_TEST_CP_KERNELS": "triton", "MAMBAC_CACHE_DIR": str(tmp_path)}
    results = run_ranks(world, "cp", timeout=180, env=env)
    lengths = (8, 11) if world == 2 else (16, 9)
    for r, res in enumerate(results):
        assert set(res) == {f"ssd/{L}" for L in lengths}, res.keys()
        for L in lengths:
            got = res[f"ssd/{L}"]
            assert got["node"] == "CPSSDFunctionBackward", got
            assert max(got["out"], got["grad"], got["final"]) <= TOL, (world, r, L, got)
