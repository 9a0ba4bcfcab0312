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
])
def test_contradictions_are_rejected(kwargs, match):
    with pytest.raises(MambacOptionsError, match=match):
        CompileOptions.create(**kwargs)


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
