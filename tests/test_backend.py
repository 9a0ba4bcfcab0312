"""torch.compile(model, backend="mambac"): discovery without importing mambac, options, parity of
logits and parameter gradients with eager (fp32, <= 1e-5) for Mamba-1/2/3 and a transformers
Mamba-2, fusion counts on dynamo's graphs, graph breaks, dynamic sequence lengths, fake inputs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from mambac.backend import MambacBackend, mambac_backend
from mambac.errors import MambacOptionsError
from mambac.models.mamba2 import Mamba2
from tests.helpers import rel_err
from tests.models.tiny import tiny_lm

NO_FUSION = dict(dt_prologue=0, delta_prologue=0, d_skip=0, z_gate=0, conv_silu=0, add_rmsnorm=0)
# What fuse_ssm folds in the two-layer tiny LMs (the same counts as mambac.compile's).
EXPECTED_FUSIONS = {
    "mamba1": dict(NO_FUSION, delta_prologue=2, d_skip=2, z_gate=2, conv_silu=2, add_rmsnorm=2),
    "mamba2_groups_hdimD_nonorm_limit": dict(NO_FUSION, dt_prologue=2, d_skip=2, z_gate=2, conv_silu=2,
                                             add_rmsnorm=2),
    "mamba3_siso": dict(NO_FUSION, add_rmsnorm=2),
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _check_parity(model: nn.Module, eager, compiled, *inputs, tol: float = 1e-5) -> None:
    """``compiled(*inputs)`` and every parameter's gradient (under a random cotangent) equal
    ``eager``'s; both compute with ``model``'s parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    out_e, out_c = eager(*inputs), compiled(*inputs)
    assert rel_err(out_c, out_e) <= tol
    cot = torch.randn_like(out_e)
    grads_e = torch.autograd.grad((out_e * cot).sum(), params)
    grads_c = torch.autograd.grad((out_c * cot).sum(), params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, a, b in zip(names, grads_c, grads_e):
        assert rel_err(a, b) <= tol, name


def _fusions(lowered) -> dict:
    return dict(lowered.ctx.stats["fuse_ssm"].counts)


def test_entry_point_finds_the_backend_without_importing_mambac(tmp_path):
    script = (
        "import json, sys, torch\n"
        "from importlib.metadata import entry_points\n"
        "assert 'mambac' not in sys.modules\n"
        "eps = [e.value for e in entry_points(group='torch_dynamo_backends') if e.name == 'mambac']\n"
        "x = torch.randn(5)\n"
        "y = torch.compile(lambda t: torch.sin(t) * 2, backend='mambac')(x)\n"
        "from torch._dynamo.utils import counters\n"
        "print(json.dumps(dict(eps=eps, ok=bool(torch.equal(y, torch.sin(x) * 2)),\n"
        "                      graphs=counters['mambac']['graphs'], imported='mambac.backend' in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == dict(eps=["mambac.backend:mambac_backend"], ok=True, graphs=1, imported=True)


@pytest.mark.parametrize("options, message", [
    (dict(wold_size=1), "unknown compile option 'wold_size'. Did you mean 'world_size'?"),
    (dict(kernels="fast"), "kernels must be one of"),
    (dict(trace_backward=True), "unknown compile option 'trace_backward'"),
    (dict(world_size=2, dp=2), "dp=2 is not supported by the torch.compile backend on several ranks"),
    (dict(world_size=2, tp=1, cp=2, cp_inputs="local"), "cp_inputs='local' is not supported by the torch.compile"),
])
def test_bad_options_reach_the_user(options, message):
    compiled = torch.compile(lambda t: t + 1, backend="mambac", options=options)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(3))
    err = getattr(info.value, "inner_exception", info.value)  # dynamo wraps it in BackendCompilerFailed
    assert isinstance(err, MambacOptionsError)
    assert message in str(info.value)


def test_several_ranks_without_a_process_group_is_a_clear_error(monkeypatch):
    """world_size > 1 needs the process group the launcher starts; without one (and without a
    launcher's environment to start it from) the backend says how to launch, before lowering."""
    import torch.distributed as dist
    from mambac.errors import MambacRuntimeError
    assert not dist.is_initialized()
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(MambacRuntimeError, match=r"options world_size=2 needs a torch.distributed process group, "
                                                 r"and none is initialised .*`mambac run -n 2 script.py`"):
        MambacBackend(world_size=2, tp=2)
    compiled = torch.compile(tiny_lm("mamba2", n_layer=1), backend="mambac", options={"world_size": 2})
    with pytest.raises(Exception) as info:
        compiled(torch.randint(0, 37, (1, 6)))
    assert isinstance(getattr(info.value, "inner_exception", None), MambacRuntimeError)
    assert counters["mambac"]["graphs"] == 0  # nothing was lowered
    with pytest.raises(MambacOptionsError, match="trace_backward=True runs on one rank only"):
        MambacBackend(world_size=2, trace_backward=True)


def test_mode_is_rejected():
    compiled = torch.compile(lambda t: t + 1, backend="mambac", mode="max-autotune")
    with pytest.raises(Exception, match="the mambac backend has no modes"):
        compiled(torch.randn(3))


@pytest.mark.parametrize("name", sorted(EXPECTED_FUSIONS))
def test_reference_lms_match_eager_and_fuse(name):
    model = tiny_lm(name)
    backend = MambacBackend()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    _check_parity(model, model, torch.compile(model, backend=backend), ids)
    assert len(backend.graphs) == 1
    lowered = backend.graphs[0]
    assert _fusions(lowered) == EXPECTED_FUSIONS[name]
    assert lowered.ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}
    assert counters["mambac"]["graphs"] == 1
    assert counters["mambac"]["fuse_ssm.add_rmsnorm"] == 2
    text = lowered.text()
    assert text.startswith("# mambac graph after 'eliminate_dead_code'")
    assert "backbone.layers.1.mixer" in text  # module paths from dynamo's nn_module_stack


def test_string_backend_counts_fusions():
    model = tiny_lm("mamba2_groups_hdimD_nonorm_limit", n_layer=1)
    torch.compile(model, backend="mambac")(torch.randint(0, 37, (1, 6)))
    assert {k: v for k, v in counters["mambac"].items() if k.startswith("fuse_ssm.")} == \
        {f"fuse_ssm.{k}": v // 2 for k, v in EXPECTED_FUSIONS["mamba2_groups_hdimD_nonorm_limit"].items()}


def test_aot_autograd_path_matches_eager():
    model = tiny_lm("mamba2", n_layer=1)
    backend = MambacBackend(trace_backward=True)
    _check_parity(model, model, torch.compile(model, backend=backend), torch.randint(0, 37, (2, 8)))
    assert _fusions(backend.graphs[0]) == dict(NO_FUSION, dt_prologue=1, d_skip=1, conv_silu=1, add_rmsnorm=1)


class BranchingMixer(nn.Module):
    """A Mamba-2 mixer, then a Python branch on a tensor's value: dynamo must break the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.mixer = Mamba2(d_model=16, d_state=8, headdim=8, chunk_size=4, rmsnorm=False)
        self.out = nn.Linear(16, 16)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        y = self.mixer(u)
        if u.sum() > 0:  # data-dependent: not capturable, runs as Python
            y = y * 2.0
        else:
            y = torch.tanh(y)
        return self.out(y)


def test_graph_break_regions_run_as_without_mambac(tmp_path):
    model = BranchingMixer()
    backend = MambacBackend(dump_dir=str(tmp_path))
    compiled = torch.compile(model, backend=backend)
    u = torch.randn(2, 7, 16)
    for x in (u, -u):  # both sides of the branch
        _check_parity(model, model, compiled, x)
    assert len(backend.graphs) == 3  # mixer + condition, then each branch's remainder
    returned = [n.meta["val"] for n in backend.graphs[0].gm.graph.output_node().all_input_nodes]
    assert any(v.dtype == torch.bool for v in returned)  # the condition goes back to Python
    assert _fusions(backend.graphs[0]) == dict(NO_FUSION, dt_prologue=1, d_skip=1, z_gate=1, conv_silu=1)
    assert [g.ctx.stats["backend"].counts["mixers.lowered"] for g in backend.graphs] == [1, 0, 0]
    dumps = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*fuse_ssm.txt"))
    assert dumps == [f"dynamo_graph_{i:03d}/rank0/02_fuse_ssm.txt" for i in range(3)]  # one folder per graph


@pytest.mark.parametrize("name", ["mamba1", "mamba3_siso"])
def test_new_lengths_recompile_once(name):
    model = tiny_lm(name, n_layer=1)
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    for seqlen in (8, 12, 16, 20):
        _check_parity(model, model, compiled, torch.randint(0, 37, (2, seqlen)))
    assert len(backend.graphs) == 2  # static at 8; 12 marks the length dynamic
    dynamic = backend.graphs[1].gm
    ids = next(n for n in dynamic.graph.nodes if n.op == "placeholder" and "input_ids" in n.name)
    assert isinstance(ids.meta["val"].shape[1], torch.SymInt)
    assert _fusions(backend.graphs[1]) == _fusions(backend.graphs[0])
    assert _fusions(backend.graphs[1]) == {k: v // 2 for k, v in EXPECTED_FUSIONS[name].items()}


def test_transformers_mamba2_matches_eager_and_lowers_once_converted():
    from mambac.convert import convert
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba2_lm_groups")
    ids = torch.randint(0, 37, (2, 8))

    def logits(m):
        return lambda x: m(x, use_cache=False).logits

    as_is = MambacBackend()
    _check_parity(model, logits(model), logits(torch.compile(model, backend=as_is)), ids)
    assert len(as_is.graphs) == 1
    # HF's mixers are recognised from nn_module_stack; their math is plain PyTorch: nothing is fused
    assert as_is.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 0, "mixers.not_lowered": 2}
    assert _fusions(as_is.graphs[0]) == NO_FUSION
    # converted first (sharing HF's parameters), it lowers as under mambac.compile
    converted = MambacBackend()
    _check_parity(model, logits(model), torch.compile(convert(model), backend=converted), ids)
    assert converted.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}
    assert _fusions(converted.graphs[0]) == dict(NO_FUSION, dt_prologue=2, d_skip=2, conv_silu=2, add_rmsnorm=2)


@pytest.mark.parametrize("fake_inputs", [False, True])
def test_backend_takes_real_or_fake_example_inputs(fake_inputs):
    from tests.passes.test_fuse_ssm import SSDBlock

    model = SSDBlock()
    inputs = model.example_inputs()
    example = inputs
    if fake_inputs:
        mode = FakeTensorMode()  # strict: the traced graph's parameters (get_attr) are real tensors
        example = [mode.from_tensor(t) for t in inputs]
    fn = mambac_backend(torch.fx.symbolic_trace(model), example)
    assert rel_err(fn(*inputs), model(*inputs)) <= 1e-6
    assert counters["mambac"]["fuse_ssm.dt_prologue"] == 1 and counters["mambac"]["fuse_ssm.z_gate"] == 1
