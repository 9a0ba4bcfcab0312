"""torch.compile(model, backend="mambac"): discovery without importing mambac, options, parity of
logits and parameter gradients with eager (fp32, <= 1e-5) for Mamba-1/2/3 and transformers'
Mamba-1/Mamba-2 (their mixers swapped for mambac's, or left as they are where that is not safe),
fusion counts on dynamo's graphs, graph breaks, dynamic sequence lengths, fake inputs."""
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
from torch.utils._python_dispatch import TorchDispatchMode

from mambac.backend import MambacBackend, mambac_backend
from mambac.errors import MambacOptionsError
from mambac.models.mamba2 import Mamba2
from tests.helpers import rel_err, worst_grad_err
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


def _check_bf16_parity(model: nn.Module, eager, compiled, *inputs, tol: float) -> None:
    """Under CPU bf16 autocast: ``compiled``'s output, and all its parameter gradients taken as one
    vector, equal ``eager``'s within ``tol``, and against the fp32 referee (autocast off) the
    compiled gradients are no further off than twice eager's own bf16 error (+5e-3).  Per parameter
    the bf16 error of a small reduction (``dt_bias``, ``D``, ``A_log``: one value per head, a sum of
    cancelling terms over a few tokens) swings past 10% in eager itself from one draw to the next,
    so those are compared at fp32 (``_check_parity``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.autocast("cpu", enabled=False):
        out32 = eager(*inputs)
    cot = torch.randn_like(out32)
    flat = lambda gs: torch.cat([g.flatten() for g in gs])  # noqa: E731
    ref = flat(torch.autograd.grad((out32 * cot).sum(), params))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_e, out_c = eager(*inputs), compiled(*inputs)
        assert rel_err(out_c, out_e) <= tol
        grads_e = flat(torch.autograd.grad((out_e * cot).sum(), params))
        grads_c = flat(torch.autograd.grad((out_c * cot).sum(), params))
    assert rel_err(grads_c, grads_e) <= tol
    assert rel_err(grads_c, ref) <= 2 * rel_err(grads_e, ref) + 5e-3


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
    (dict(cuda_graphs=True), "cuda_graphs=True is not supported by the torch.compile backend"),
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


@pytest.mark.parametrize("name", sorted(EXPECTED_FUSIONS))
def test_bf16_reference_lms_fuse_and_match_float64(name):
    """A reference LM cast to bf16 (fp32 residual stream): the same fusions as in fp32, and
    logits and gradients as close to a float64 copy as eager bf16 is."""
    import copy

    m64 = tiny_lm(name, seed=2).double()
    model = copy.deepcopy(m64).to(torch.bfloat16)
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(3))
    out_c, out_e, out_64 = compiled(ids), model(ids), m64(ids)
    assert out_c.dtype == torch.bfloat16
    assert rel_err(out_c, out_64) <= 2 * rel_err(out_e, out_64) + 1e-3
    assert _fusions(backend.graphs[0]) == EXPECTED_FUSIONS[name]
    cot = torch.randn(out_64.shape, dtype=torch.float64)
    params, p64 = list(model.parameters()), list(m64.parameters())
    worst_c = worst_grad_err(out_c, out_64, cot, params, p64)
    worst_e = worst_grad_err(out_e, m64(ids), cot, params, p64)
    assert worst_c <= 2 * worst_e + 1e-2, (worst_c, worst_e)


def test_bf16_transformers_model_matches_float64():
    """An HF model loaded in bf16 (fp32 residual stream: HF's casts before the norms are real
    casts here, so the sums are not folded into the norms) gives logits as close to a float64
    copy as HF's own bf16 forward."""
    import copy
    from tests.convert.hf_models import hf_model

    m64 = hf_model("mamba2_lm_groups").double()
    model = copy.deepcopy(m64).to(torch.bfloat16)
    backend = MambacBackend()
    ids = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(4))
    out_c = _hf_logits(torch.compile(model, backend=backend))(ids)
    want = _hf_logits(m64)(ids)
    assert rel_err(out_c, want) <= 2 * rel_err(_hf_logits(model)(ids), want) + 1e-3
    assert backend.graphs[0].ctx.stats["backend"].counts["mixers.lowered"] == 2


def test_string_backend_counts_fusions():
    model = tiny_lm("mamba2_groups_hdimD_nonorm_limit", n_layer=1)
    torch.compile(model, backend="mambac")(torch.randint(0, 37, (1, 6)))
    assert {k: v for k, v in counters["mambac"].items() if k.startswith("fuse_ssm.")} == \
        {f"fuse_ssm.{k}": v // 2 for k, v in EXPECTED_FUSIONS["mamba2_groups_hdimD_nonorm_limit"].items()}


class _OpsRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("trace_backward", [None, False], ids=["default_aot", "ops_rules"])
def test_backward_goes_through_aot_autograd_with_opaque_op_backwards(trace_backward):
    """By default (one rank) the lowered graph goes through AOTAutograd, and each mambac op's
    backward is one node of the traced backward graph (``mambac::<op>_backward``), never the
    unrolled reference; ``trace_backward=False`` runs the ops' autograd rules directly."""
    model = tiny_lm("mamba2", n_layer=1)
    backend = MambacBackend() if trace_backward is None else MambacBackend(trace_backward=False)
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 37, (2, 8))
    _check_parity(model, model, compiled, ids)
    assert _fusions(backend.graphs[0]) == dict(NO_FUSION, dt_prologue=1, d_skip=1, conv_silu=1, add_rmsnorm=1)
    loss = compiled(ids, ids)
    with _OpsRecorder() as rec:
        loss.backward()
    opaque = {n for n in rec.names if n.startswith("mambac.") and n.endswith("_backward.default")}
    if trace_backward is None:
        assert opaque == {"mambac.ssd_backward.default", "mambac.causal_conv1d_backward.default",
                          "mambac.add_rmsnorm_backward.default", "mambac.gated_rmsnorm_backward.default",
                          "mambac.linear_cross_entropy_backward.default"}, rec.names
    else:
        assert not opaque


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


def _over_three_lengths(model: nn.Module):
    """(backend, compiled): ``model`` under ``torch.compile`` with a fresh ``MambacBackend``, run
    with labels at lengths 8, 12 and 17, each with eager's loss and gradients."""
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    for seqlen in (8, 12, 17):
        ids, labels = torch.randint(0, 37, (2, seqlen)), torch.randint(0, 37, (2, seqlen))
        _check_parity(model, model, compiled, ids, labels)
    return backend, compiled


def test_lm_loss_is_fused_and_new_lengths_keep_one_dynamic_graph():
    """With labels the LM head and its cross-entropy (``F.linear`` in dynamo's graph) become one
    chunked ``linear_cross_entropy`` op, as through ``mambac.compile``; the op is one node for any
    token count, so after the second length one dynamic graph serves the rest, with eager's loss
    and gradients (also under bf16 autocast, with the bf16 head the unfused loss would run)."""
    model = tiny_lm("mamba2")
    backend, compiled = _over_three_lengths(model)
    assert len(backend.graphs) == 2
    assert [g.ctx.stats["fuse_loss"].counts["linear_cross_entropy"] for g in backend.graphs] == [1, 1]
    ids, labels = torch.randint(0, 37, (2, 12)), torch.randint(0, 37, (2, 12))
    _check_bf16_parity(model, model, compiled, ids, labels, tol=2e-2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = model(ids, labels)
        got = compiled(ids, labels)
    assert got.dtype == want.dtype == torch.float32 and rel_err(got, want) <= 1e-2


def _assert_fakes_carry_the_length(grab) -> None:
    """Compile a one-layer LM with the backend ``grab`` (which keeps the fakes it propagates as
    ``grab.got``) at two lengths: the data tensors' fakes of the second, dynamic graph carry the
    graph's own length symbol, and parameters stay as given."""
    compiled = torch.compile(tiny_lm("mamba2", n_layer=1), backend=grab)
    for seqlen in (8, 12):
        compiled(torch.randint(0, 37, (2, seqlen)), torch.randint(0, 37, (2, seqlen)))
    data = [t for t in grab.got if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)]
    lengths = {str(t) for t in grab.got if isinstance(t, torch.SymInt)}
    assert len(data) == 2 and len(lengths) == 1
    assert all(isinstance(t.shape[1], torch.SymInt) and str(t.shape[1]) in lengths for t in data)
    assert any(isinstance(t, nn.Parameter) for t in grab.got)


def test_shapes_are_propagated_from_dynamos_own_fake_inputs():
    """The backend fakifies the real inputs with the symbolic contexts dynamo traced them with (as
    AOTAutograd does), so their fakes carry dynamo's own length symbol, the graph's SymInt input.
    (Fakes of their own sizes would be related to dynamo's by the loss, which pins the length.)
    Parameters stay as given."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode
    from mambac.backend import _dynamo_fakes
    contexts = []

    class Recording(FakeTensorMode):
        def from_tensor(self, t, *args, **kwargs):
            contexts.append(kwargs.get("symbolic_context"))
            return super().from_tensor(t, *args, **kwargs)

    def grab(gm, example_inputs):
        mode = Recording(shape_env=detect_fake_mode(list(example_inputs)).shape_env)
        contexts.clear()
        grab.got = _dynamo_fakes(example_inputs, mode)
        return gm.forward

    _assert_fakes_carry_the_length(grab)
    assert len(contexts) == 2 and None not in contexts


@pytest.mark.parametrize("contexts", ["none", "empty"])
def test_inputs_without_a_symbolic_context_take_dynamos_traced_fakes(monkeypatch, contexts):
    """Where the backend finds no symbolic context of dynamo's for an input tensor, the propagation
    takes the fake dynamo traced that placeholder with: the data tensors' fakes carry the graph's
    length symbol (not a size of their own), parameters stay as given; and one dynamic graph
    serves every later length, with eager's loss and gradients."""
    from torch._guards import detect_fake_mode
    import mambac.backend as backend_module
    from mambac.backend import _dynamo_fakes
    monkeypatch.setattr(backend_module, "_symbolic_contexts", lambda: None if contexts == "none" else {})

    def grab(gm, example_inputs):
        grab.got = _dynamo_fakes(example_inputs, detect_fake_mode(list(example_inputs)), gm)
        return gm.forward

    _assert_fakes_carry_the_length(grab)
    torch._dynamo.reset()
    backend, _ = _over_three_lengths(tiny_lm("mamba2", n_layer=1))
    assert len(backend.graphs) == 2


def _remat_regions(lowered) -> list[str]:
    return [n.name for n in lowered.gm.graph.nodes if n.op == "call_module" and n.name.startswith("remat_")]


@pytest.mark.parametrize("remat", ["full", "auto"])
def test_remat_through_aot_autograd_keeps_one_dynamic_graph(remat):
    """remat on one rank goes through AOTAutograd (the replay lands in the traced backward) and,
    without a budget, its regions do not depend on the length: after the second length one
    dynamic graph serves every later one, with eager's values and gradients."""
    model = tiny_lm("mamba2")
    backend = MambacBackend(remat=remat)
    compiled = torch.compile(model, backend=backend)
    for seqlen in (8, 12, 17):
        _check_parity(model, model, compiled, torch.randint(0, 37, (2, seqlen)))
    assert len(backend.graphs) == 2
    ids = next(n for n in backend.graphs[1].gm.graph.nodes if n.op == "placeholder" and "input_ids" in n.name)
    assert isinstance(ids.meta["val"].shape[1], torch.SymInt)
    assert _remat_regions(backend.graphs[1]) == _remat_regions(backend.graphs[0]) != []


def test_remat_under_a_budget_is_planned_per_length():
    """A plan chosen to meet memory_budget holds at the sizes it was chosen for: each length is
    lowered and planned again (no dynamic graph), and each plan meets the budget there."""
    from mambac.memory import MEMORY_PLAN
    model = tiny_lm("mamba2")
    backend = MambacBackend(remat="auto", memory_budget=40_000)
    compiled = torch.compile(model, backend=backend)
    for seqlen in (8, 12, 17):
        _check_parity(model, model, compiled, torch.randint(0, 37, (2, seqlen)))
    assert len(backend.graphs) == 3
    for lowered, seqlen in zip(backend.graphs, (8, 12, 17)):
        plan = lowered.gm.meta[MEMORY_PLAN]
        assert plan.model.example == (2, seqlen)
        assert plan.regions and plan.predicted <= plan.budget < plan.baseline


def _hf_logits(m):
    return lambda x, **kw: m(x, use_cache=False, **kw).logits


def _mixer_fusions(lowered) -> dict:
    """fuse_ssm's counts inside the mixers (add_rmsnorm folds the blocks' residual add and norm,
    which stay HF's own code when the HF model is compiled as it is)."""
    return {k: v for k, v in _fusions(lowered).items() if k != "add_rmsnorm"}


@pytest.mark.parametrize("case", ["mamba2_lm_groups", "mamba_lm"])
def test_transformers_mixers_are_swapped_and_fused_as_converted(case):
    """HF's mixers in dynamo's graph are replaced by mambac's captured mixers on the HF parameters:
    logits and every HF parameter's gradient equal HF eager, and the mixers fuse as under
    mambac.compile(convert(model))."""
    from mambac.convert import convert
    from tests.convert.hf_models import hf_model

    model = hf_model(case)
    ids = torch.randint(0, 37, (2, 8))
    as_is = MambacBackend()
    _check_parity(model, _hf_logits(model), _hf_logits(torch.compile(model, backend=as_is)), ids)
    assert len(as_is.graphs) == 1
    lowered = as_is.graphs[0]
    assert lowered.ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}
    hf_mixers = [m for m in model.modules() if type(m).__name__.endswith("Mixer")]
    swapped = [m for name, m in vars(lowered.gm).items() if name.startswith("mambac_mixer_")]
    assert len(swapped) == 2
    for ours, theirs in zip(swapped, hf_mixers):  # the HF parameters themselves, not copies
        assert {n: id(p) for n, p in ours.named_parameters()} == {n: id(p) for n, p in theirs.named_parameters()}
    converted = MambacBackend()
    _check_parity(model, _hf_logits(model), torch.compile(convert(model), backend=converted), ids)
    assert converted.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}
    assert _fusions(lowered) == _fusions(converted.graphs[0])  # the residual adds fold too
    assert sum(_mixer_fusions(lowered).values()) >= 6  # conv+SiLU, D skip, dt / delta prologue per layer
    # the two blocks' norms and norm_f are mambac's RMSNorm op; the second block's and norm_f fold
    # the residual sum before them (HF's no-op cast of the sum dropped), the first reads embeddings
    norms = [n for n in lowered.gm.graph.nodes if n.target is torch.ops.mambac.add_rmsnorm.default]
    assert len(norms) == 3 and [n.args[1] is None for n in norms] == [True, False, False]
    assert not any(n.target == "pow" or n.target is torch.rsqrt for n in lowered.gm.graph.nodes)


def test_transformers_model_under_bf16_autocast_folds_the_same_and_matches_eager():
    """Under CPU bf16 autocast the residual sums stay fp32 (residual_in_fp32), HF's casts before the
    norms are still no-ops and fold as in fp32; logits and gradients equal HF eager under the same
    autocast within bf16 tolerances (5e-2: the swapped mixers round differently from HF's code, as
    they do without the norms swapped; the gradients as one vector, see ``_check_bf16_parity``)."""
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba2_lm_groups")
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 37, (2, 8))
    _check_bf16_parity(model, _hf_logits(model), _hf_logits(compiled), ids, tol=5e-2)
    assert _fusions(backend.graphs[0])["add_rmsnorm"] == 2
    assert backend.graphs[0].ctx.stats["backend"].counts["mixers.lowered"] == 2


def test_transformers_swapped_mixers_through_aot_autograd():
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba2_lm_groups")
    backend = MambacBackend(trace_backward=True)
    _check_parity(model, _hf_logits(model), _hf_logits(torch.compile(model, backend=backend)),
                  torch.randint(0, 37, (2, 8)))
    assert backend.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}


def test_transformers_mamba2_new_length_lowers_with_symbolic_sizes():
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba2_lm_oddheads")
    backend = MambacBackend()
    compiled = _hf_logits(torch.compile(model, backend=backend))
    for seqlen in (8, 11):  # 11 is not a multiple of the chunk size (4)
        _check_parity(model, _hf_logits(model), compiled, torch.randint(0, 37, (2, seqlen)))
    assert len(backend.graphs) == 2
    dynamic = backend.graphs[1]
    ids = next(n.meta["val"] for n in dynamic.gm.graph.nodes
               if n.op == "placeholder" and isinstance(n.meta["val"], torch.Tensor) and n.meta["val"].dim() == 2
               and n.meta["val"].dtype == torch.long)
    assert isinstance(ids.shape[1], torch.SymInt)
    assert dynamic.ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}
    assert _fusions(dynamic) == _fusions(backend.graphs[0])


def test_transformers_mixer_with_attention_mask_runs_unlowered(caplog):
    """An attention mask that is not None reaches every mixer: the regions stay HF's code, with a
    warning that says why, and the results equal eager."""
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba2_lm_groups")
    ids = torch.randint(0, 37, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level("WARNING", logger="mambac.backend"):
        _check_parity(model, lambda x: _hf_logits(model)(x, attention_mask=mask),
                      lambda x: _hf_logits(compiled)(x, attention_mask=mask), ids)
    assert backend.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 0, "mixers.not_lowered": 2}
    assert _fusions(backend.graphs[0]) == dict(NO_FUSION, add_rmsnorm=2)  # the norms are still mambac's
    assert "tensor input(s) besides its parameters" in caplog.text
    assert "backbone.layers.1.mixer" in caplog.text


def test_transformers_generation_cache_keeps_mamba2_mixers_unlowered_and_says_how(caplog):
    """With the config's use_cache=True, transformers gives each call a generation cache, which
    reaches the Mamba-2 mixers: they stay HF's code, the results equal eager, and the warning names
    the fix (use_cache=False); with use_cache=False they are swapped."""
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba2_lm_groups")
    model.config.use_cache = True
    ids = torch.randint(0, 37, (2, 8))
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    with caplog.at_level("WARNING", logger="mambac.backend"):
        _check_parity(model, lambda x: model(x).logits, lambda x: compiled(x).logits, ids)
    assert backend.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 0, "mixers.not_lowered": 2}
    assert "each call not made with use_cache=False" in caplog.text
    _check_parity(model, _hf_logits(model), _hf_logits(compiled), ids)
    assert backend.graphs[-1].ctx.stats["backend"].counts == {"mixers.lowered": 2, "mixers.not_lowered": 0}


def test_state_changing_calls_with_unused_results_survive_the_passes():
    """dynamo records ``vmap``'s level counters (and grad-mode switches) as calls whose results
    nobody reads; dead-code elimination keeps them, so a vmapped region runs as in eager."""
    def f(x, w):
        with torch.no_grad():
            n = x.norm()
        return torch.vmap(lambda a: (a * w).sum())(x).sin() + n

    backend = MambacBackend()
    x, w = torch.randn(4, 3), torch.randn(3)
    torch.testing.assert_close(torch.compile(f, backend=backend)(x, w), f(x, w))
    names = [getattr(n.target, "__name__", "") for n in backend.graphs[0].gm.graph.nodes]
    assert {"_vmap_increment_nesting", "_vmap_decrement_nesting", "_set_grad_enabled"} <= set(names)


def test_transformers_mamba1_mixer_with_attention_mask_runs_unlowered():
    """HF's Mamba-1 mixer left as its own code (a mask reaches it) runs through the passes as in
    eager, vmap included."""
    from tests.convert.hf_models import hf_model

    model = hf_model("mamba_lm")
    ids = torch.randint(0, 37, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :2] = 0
    backend = MambacBackend()
    compiled = torch.compile(model, backend=backend)
    _check_parity(model, lambda x: _hf_logits(model)(x, attention_mask=mask),
                  lambda x: _hf_logits(compiled)(x, attention_mask=mask), ids)
    assert backend.graphs[0].ctx.stats["backend"].counts.get("mixers.lowered", 0) == 0


def test_transformers_mixer_conversion_failure_falls_back(monkeypatch, caplog):
    import mambac.convert.hf as hf
    from mambac.errors import MambacConfigError
    from tests.convert.hf_models import hf_model

    def refuse(mixer):
        raise MambacConfigError("no such setting")

    monkeypatch.setattr(hf, "convert_mixer", refuse)
    model = hf_model("mamba2_lm_oddheads")
    backend = MambacBackend()
    with caplog.at_level("WARNING", logger="mambac.backend"):
        _check_parity(model, _hf_logits(model), _hf_logits(torch.compile(model, backend=backend)),
                      torch.randint(0, 37, (2, 8)))
    assert backend.graphs[0].ctx.stats["backend"].counts == {"mixers.lowered": 0, "mixers.not_lowered": 2}
    assert "mambac cannot convert it: no such setting" in caplog.text


def test_transformers_graph_break_inside_a_mixer_runs_as_eager(monkeypatch):
    """A graph break inside HF's mixer: no graph holds a whole mixer, nothing is swapped, and the
    results equal eager."""
    import transformers.models.mamba2.modeling_mamba2 as modeling
    from tests.convert.hf_models import hf_model

    masking = modeling.apply_mask_to_padding_states

    def breaking(hidden_states, attention_mask):
        torch._dynamo.graph_break()
        return masking(hidden_states, attention_mask)

    monkeypatch.setattr(modeling, "apply_mask_to_padding_states", breaking)
    model = hf_model("mamba2_lm_groups")
    backend = MambacBackend()
    _check_parity(model, _hf_logits(model), _hf_logits(torch.compile(model, backend=backend)),
                  torch.randint(0, 37, (2, 8)))
    assert len(backend.graphs) > 1
    assert all(g.ctx.stats["backend"].counts.get("mixers.lowered", 0) == 0 for g in backend.graphs)


def test_hf_mixer_conversion_matches_the_mixer():
    """convert_mixer: mambac's mixer on the HF mixer's own tensors computes what the HF mixer does."""
    from mambac.convert.hf import convert_mixer
    from tests.convert.hf_models import hf_model

    for case in ("mamba_lm_quirks", "mamba2_lm_oddheads"):
        hf_mixer = hf_model(case).backbone.layers[0].mixer
        ours = convert_mixer(hf_mixer).model
        u = torch.randn(2, 7, hf_mixer.hidden_size)
        assert rel_err(ours(u), hf_mixer(u)) <= 1e-5, case
        theirs = dict(hf_mixer.named_parameters())
        assert all(p is theirs[name] for name, p in ours.named_parameters()), case


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
