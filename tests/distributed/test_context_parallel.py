"""Context parallelism on 2 and 4 gloo ranks: the conv halo exchange and the state passing of the
Mamba-1, Mamba-2 and Mamba-3 (SISO, MIMO) scans give each rank its piece of the single-process
output, the input gradients summed over the ranks equal the single-process ones, and the last
rank's final states are the sequence's (fp32, <= 1e-5 relative), at lengths that are and are not
multiples of ranks x chunk."""
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
