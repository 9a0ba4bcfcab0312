import pytest

import mambac
from mambac.errors import MambacOptionsError
from mambac.options import CompileOptions
from tests.models.tiny import tiny_lm


def test_unknown_option_suggests_the_closest():
    with pytest.raises(MambacOptionsError, match="Did you mean 'sequence_parallel'"):
        CompileOptions.create(sequence_paralel=True)


@pytest.mark.parametrize("kwargs,match", [
    (dict(world_size=0), "positive integer"),
    (dict(world_size=4, tp=3), "does not multiply"),
    (dict(remat="sometimes"), "remat must be one of"),
    (dict(memory_budget=10), "only used with remat='auto'"),
    (dict(kernels="cuda"), "kernels must be one of"),
    (dict(world_size=2, sequence_parallel=True, tp=1, dp=2), "needs tensor parallelism"),
    (dict(cuda_graphs="yes"), "cuda_graphs must be True or False"),
    (dict(cuda_graphs=1), "cuda_graphs must be True or False"),
    (dict(world_size=2, tp=2, sequence_parallel="yes"), "sequence_parallel must be True or False"),
    (dict(verify="no"), "verify must be True or False"),
    (dict(tp=2), "for 2 ranks pass world_size=2"),
    (dict(remat="auto", memory_budget="lots"), "memory_budget: cannot read 'lots' as a size"),
    (dict(remat="auto", memory_budget="-1GiB"), "memory_budget: cannot read"),
    (dict(remat="auto", memory_budget=0.4), "memory_budget must be a positive number of bytes"),
])
def test_contradictions_are_rejected(kwargs, match):
    with pytest.raises(MambacOptionsError, match=match):
        CompileOptions.create(**kwargs)


@pytest.mark.parametrize("given, size", [(8 * 2**30, 8 * 2**30), (8e9, 8 * 10**9), ("8GiB", 8 * 2**30),
                                         ("512 MiB", 512 * 2**20), ("2.5e5", 250_000), ("141GB", 141 * 10**9)])
def test_memory_budget_reads_sizes_as_the_cli_does(given, size):
    opts = CompileOptions.create(remat="auto", memory_budget=given)
    assert opts.memory_budget == size and isinstance(opts.memory_budget, int)


def test_defaults():
    opts = CompileOptions.create()
    assert (opts.world_size, opts.tp, opts.dp, opts.cp, opts.remat) == (1, 1, 1, 1, "none")
    assert opts.cuda_graphs is False


def test_errors_come_before_any_state_change():
    model = tiny_lm("mamba2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MambacOptionsError):
        mambac.compile(model, bogus=1)
    assert all((before[k] == v).all() for k, v in model.state_dict().items())
