"""mambac.compile at world_size 1: outputs and parameter gradients equal eager (fp32, ≤ 1e-5)."""
import pytest
import torch

import mambac
from mambac.errors import MambacInputError
from mambac.runtime.compiled_module import CompiledModule
from tests.helpers import rel_err, worst_grad_err
from tests.models.tiny import VARIANTS, tiny_lm


def _grads(loss, params):
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("seqlen", [9, 16])
def test_logits_and_grads_match_eager(name, seqlen):
    model = tiny_lm(name)
    compiled = mambac.compile(model)
    ids = torch.randint(0, model.config.vocab_size, (2, seqlen))
    params = [p for p in model.parameters()]
    out_e, out_c = model(ids), compiled(ids)
    assert rel_err(out_c, out_e) <= 1e-5
    cot = torch.randn_like(out_e)
    ge = _grads((out_e * cot).sum(), params)
    gc = _grads((out_c * cot).sum(), params)
    for (n, _), a, b in zip(model.named_parameters(), gc, ge):
        assert rel_err(a, b) <= 1e-5, n


def test_loss_signature_is_lowered_separately():
    model = tiny_lm("mamba2")
    compiled = mambac.compile(model)
    ids = torch.randint(0, 37, (2, 8))
    labels = torch.randint(0, 37, (2, 8))
    assert rel_err(compiled(ids, labels), model(ids, labels)) <= 1e-6
    assert len(compiled.programs) == 2


def test_compiled_module_shares_weights_and_keys():
    model = tiny_lm("mamba2")
    compiled = mambac.compile(model)
    assert list(compiled.state_dict()) == list(model.state_dict())
    assert all(a is b for a, b in zip(compiled.parameters(), model.parameters()))
    sd = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    compiled.load_state_dict(sd)
    ids = torch.randint(0, 37, (1, 6))
    assert rel_err(compiled(ids), model(ids)) <= 1e-5


def test_training_steps_match_eager():
    a, b = tiny_lm("mamba2", seed=3), tiny_lm("mamba2", seed=3)
    compiled = mambac.compile(b)
    oa, ob = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    for _ in range(3):
        ids = torch.randint(0, 37, (2, 10))
        for model, opt in ((a, oa), (compiled, ob)):
            opt.zero_grad()
            model(ids[:, :-1], ids[:, 1:]).backward()
            opt.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert rel_err(q, p) <= 1e-5, n


def test_fusions_are_applied_and_counted():
    compiled = mambac.compile(tiny_lm("mamba2_groups_hdimD_nonorm_limit"))
    stats = next(iter(compiled.programs.values())).ctx.stats["fuse_ssm"].counts
    assert stats == {"dt_prologue": 2, "delta_prologue": 0, "d_skip": 2, "z_gate": 2, "conv_silu": 2,
                     "add_rmsnorm": 2}
    text = compiled.lowered_graph_text()
    assert text.startswith("# mambac graph after 'eliminate_dead_code'")
    assert "F.softplus" not in text and "F.silu" not in text and "torch.clamp" not in text


def test_bad_token_ids_are_rejected_before_running():
    compiled = mambac.compile(tiny_lm("mamba2"))
    lowered = dict(compiled.programs)
    with pytest.raises(MambacInputError, match="outside"):
        compiled(torch.tensor([[0, 40]]))
    with pytest.raises(MambacInputError, match="int64"):
        compiled(torch.zeros(1, 4))
    with pytest.raises(MambacInputError, match=r"\(batch, seqlen\).*shape \(5,\) \(one sequence: ids\[None\]\)"):
        compiled(torch.zeros(5, dtype=torch.int64))
    with pytest.raises(MambacInputError, match=r"shape \(2, 3, 5\)"):
        compiled(torch.zeros(2, 3, 5, dtype=torch.int64))
    for empty in ((0, 5), (2, 0)):
        with pytest.raises(MambacInputError, match="hold no tokens"):
            compiled(torch.zeros(empty, dtype=torch.int64))
    with pytest.raises(MambacInputError, match=r"labels must lie in \[0, 40\) or be -100"):
        compiled(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[1, -100, 40, 2]]))
    assert compiled.programs == lowered   # nothing was lowered for the bad calls


def test_example_inputs_take_a_bare_tensor_and_get_the_call_checks():
    """``example_inputs=ids`` is the forward's one argument (not one argument per row), lowered at
    compile; example ids the model could not take fail there with the call's clear error."""
    model = tiny_lm("mamba2")
    ids = torch.randint(0, 37, (2, 8))
    compiled = mambac.compile(model, example_inputs=ids)
    assert len(compiled.programs) == 1 and rel_err(compiled(ids), model(ids)) == 0.0
    with pytest.raises(MambacInputError, match="integer token ids"):
        mambac.compile(model, example_inputs=(ids.float(),))
    with pytest.raises(MambacInputError, match=r"this batch has 99\.\.99"):
        mambac.compile(model, example_inputs=(torch.full((2, 8), 99),))


def test_unshifted_labels_warn_with_the_shift_to_use():
    """Labels that are the input ids themselves (Hugging Face's labels=ids, which HF shifts inside)
    warn that mambac's labels are already shifted and say how; shifted labels do not warn."""
    import warnings

    compiled = mambac.compile(tiny_lm("mamba2"))
    ids = torch.randint(0, 37, (2, 9))
    with pytest.warns(UserWarning, match=r"labels are input_ids themselves.*\(ids\[:, :-1\], ids\[:, 1:\]\)"):
        compiled(ids, ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled(ids[:, :-1], ids[:, 1:])


def test_compile_rejects_non_modules_and_double_compile():
    with pytest.raises(MambacInputError, match="nn.Module"):
        mambac.compile("not a model")
    c = mambac.compile(tiny_lm("mamba1"))
    with pytest.raises(MambacInputError, match="already compiled"):
        mambac.compile(c)


def test_first_call_inside_autocast_returns_real_tensors():
    from torch._subclasses.fake_tensor import FakeTensor

    model = tiny_lm("mamba2")
    compiled = CompiledModule(model, mambac.CompileOptions.create())  # nothing lowered yet
    ids = torch.randint(0, 37, (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = compiled(ids)      # lowered here, inside autocast
        second = compiled(ids)
        eager = model(ids)
    assert not isinstance(first, FakeTensor) and not isinstance(second, FakeTensor)
    assert rel_err(second, eager) <= 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_half_models_match_eager_and_float64(name, dtype):
    """A model cast to bf16 or fp16 (its residual stream kept in fp32, the default) runs eagerly
    and compiled, and the compiled one is as close to a float64 copy as eager is in that dtype."""
    import copy

    m64 = tiny_lm(name, seed=3).double()
    model = copy.deepcopy(m64).to(dtype)
    compiled = mambac.compile(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    out_e, out_c, out_64 = model(ids), compiled(ids), m64(ids)
    assert out_c.dtype == out_e.dtype == dtype
    err_c, err_e = rel_err(out_c, out_64), rel_err(out_e, out_64)
    assert err_c <= 3e-2 and err_c <= 2 * err_e + 1e-3, (err_c, err_e)
    cot = torch.randn(out_64.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    params, p64 = list(model.parameters()), list(m64.parameters())
    g_c = worst_grad_err(out_c, out_64, cot, params, p64)
    g_e = worst_grad_err(model(ids), m64(ids), cot, params, p64)
    assert g_c <= 0.3 and g_c <= 2 * g_e + 1e-2, (g_c, g_e)   # bf16 eager itself reaches 0.15 on some


def test_pickles_and_deep_copies_as_model_and_options(tmp_path):
    """torch.save / torch.load and copy.deepcopy of a compiled module give a compiled module of the
    copied model (its parameters shared with that copy, not with the original), with the same
    options and input checks, that lowers again on its first call and computes the same logits."""
    import copy

    model = tiny_lm("mamba2")
    compiled = mambac.compile(model, remat="full")
    ids = torch.randint(0, 37, (2, 11))
    ref = compiled(ids)
    torch.save(compiled, tmp_path / "compiled.pt")
    for other in (torch.load(tmp_path / "compiled.pt", weights_only=False), copy.deepcopy(compiled)):
        assert isinstance(other, CompiledModule) and other.options == compiled.options
        assert other.original_module is not model and not other.programs
        assert [id(p) for p in other.parameters()] == [id(p) for p in other.original_module.parameters()]
        assert not {id(p) for p in other.parameters()} & {id(p) for p in model.parameters()}
        assert rel_err(other(ids), ref) == 0.0
        with pytest.raises(MambacInputError, match="outside"):
            other(torch.full((1, 4), 999))


def test_model_attributes_reach_through_on_one_rank_only():
    """What the compiled module lacks is the model's own (a helper method reads the shared,
    trained weights; a plain field); an attribute neither has is an AttributeError naming the
    model.  Compiled for two ranks (lowered offline, no process group), a method or module of the
    model is refused with the reason, and a plain value still passes."""
    model = tiny_lm("mamba2")
    model.note = "kept"
    model.head_norm = lambda: model.lm_head.weight.norm()
    compiled = mambac.compile(model)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    assert compiled.note == "kept" and compiled.head_norm() == model.lm_head.weight.norm()
    assert compiled.config is model.config
    with pytest.raises(AttributeError, match=f"nor its model \\({type(model).__name__}\\)"):
        compiled.missing
    assert not hasattr(compiled, "__deepcopy__")   # the copy protocol's probes are not passed on
    sharded = mambac.compile(model, world_size=2, tp=2)
    assert sharded.note == "kept" and sharded.config is model.config
    with pytest.raises(AttributeError, match="untrained, unsharded weights"):
        sharded.head_norm


def test_triton_kernels_on_the_cpu_without_the_interpreter_warn(monkeypatch):
    """kernels='triton' for a CPU model runs the generated kernels only in Triton's interpreter;
    without it the compile says that the reference ops run (and they do)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = tiny_lm("mamba2")
    with pytest.warns(UserWarning, match="runs the reference ops.*TRITON_INTERPRET=1"):
        compiled = mambac.compile(model, kernels="triton")
    ids = torch.randint(0, 37, (2, 8))
    assert rel_err(compiled(ids), model(ids)) <= 1e-6
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mambac.compile(model, kernels="triton", example_inputs=(ids,))


class _ModeDependent(torch.nn.Module):
    """Branches on training flags (read at capture) at its root and in a submodule."""

    def __init__(self) -> None:
        super().__init__()
        from mambac.models import Mamba2
        self.mixer = Mamba2(16, d_state=8, headdim=8, chunk_size=4)
        self.scale = _TrainScale()

    def forward(self, x):
        y = self.scale(self.mixer(x))
        return y * 2 if self.training else y


class _TrainScale(torch.nn.Module):
    def forward(self, x):
        return x - 1 if self.training else x


def test_training_and_eval_modes_get_their_own_programs():
    """``if self.training:`` is decided when a graph is captured: each combination of the modules'
    flags has its own programs, whichever module (compiled or original, root or child) is switched,
    and switching back reuses the program lowered before."""
    model = _ModeDependent()
    compiled = mambac.compile(model)
    x = torch.randn(2, 8, 16)
    assert rel_err(compiled(x), model(x)) <= 1e-6
    first = compiled.program_for(x)
    compiled.eval()
    assert not model.training and not model.scale.training
    assert rel_err(compiled(x), model(x)) <= 1e-6 and compiled.program_for(x) is not first
    model.train()
    model.scale.eval()   # mixed flags: a third program
    assert rel_err(compiled(x), model(x)) <= 1e-6
    compiled.train()
    assert compiled.program_for(x) is first and rel_err(compiled(x), model(x)) <= 1e-6
