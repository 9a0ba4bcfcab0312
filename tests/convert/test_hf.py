"""Hugging Face Mamba / Mamba-2 models: converted and compiled models equal HF's own eager forward,
share its parameters, and give its state dict back under HF's names."""
import copy

import warnings

import pytest
import torch

import mambac
from mambac.convert import convert, hf, key_map, load_original_state_dict, original_state_dict
from mambac.errors import MambacConfigError, MambacInputError
from mambac.models import MambaLMHeadModel
from mambac.models.lm import MixerModel
from tests.convert.hf_models import CASES, hf_model, hf_output
from tests.helpers import rel_err


def _grads(out: torch.Tensor, cot: torch.Tensor, params: list) -> tuple:
    return torch.autograd.grad((out * cot).sum(), params)


@pytest.mark.parametrize("name", ["mamba_lm_quirks", "mamba_backbone", "mamba2_lm_oddheads",
                                  "mamba2_backbone_oddheads"])
def test_compiled_matches_hf_logits_and_grads(name):
    model = hf_model(name)
    compiled = mambac.compile(model)
    ids = torch.randint(0, 37, (2, 9))
    params = list(model.parameters())
    ref, out = hf_output(model, ids), compiled(ids)
    assert rel_err(out, ref) <= 1e-5
    cot = torch.randn_like(ref)
    for (n, _), a, b in zip(model.named_parameters(), _grads(out, cot, params), _grads(ref, cot, params)):
        assert rel_err(a, b) <= 1e-4, n


@pytest.mark.parametrize("name", sorted(CASES))
def test_converted_eager_matches_hf(name):
    model = hf_model(name, seed=1)
    converted = convert(model)
    assert isinstance(converted, MixerModel if CASES[name][0].endswith("Model") else MambaLMHeadModel)
    ids = torch.randint(0, 37, (3, 7))
    assert rel_err(converted(ids), hf_output(model, ids)) <= 1e-5


@pytest.mark.parametrize("name", ["mamba_lm", "mamba_lm_quirks", "mamba2_lm_groups", "mamba2_lm_oddheads"])
def test_converted_shares_every_parameter(name):
    model = hf_model(name)
    converted = convert(model)
    ours = {id(p) for p in converted.parameters()}
    assert ours == {id(p) for p in model.parameters()}
    assert all(p.device.type == "cpu" for p in converted.parameters())
    tied = model.lm_head.weight is model.backbone.embeddings.weight
    assert converted.config.tie_embeddings == tied
    assert (converted.lm_head.weight is converted.backbone.embedding.weight) == tied


@pytest.mark.parametrize("name", ["mamba_lm_quirks", "mamba2_backbone_oddheads"])
def test_state_dict_round_trips_to_hf_names(name):
    model = hf_model(name)
    converted = convert(model)
    sd = original_state_dict(converted)
    assert list(sd) == [key_map(converted)[k] for k in converted.state_dict()]
    assert set(sd) == set(model.state_dict())
    assert all(sd[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())
    fresh = hf_model(name, seed=7)
    fresh.load_state_dict(sd)  # HF names, HF model: loads strictly
    ids = torch.randint(0, 37, (1, 5))
    assert rel_err(hf_output(fresh, ids), hf_output(model, ids)) == 0
    other = convert(hf_model(name, seed=8))
    load_original_state_dict(other, model.state_dict())
    assert rel_err(other(ids), converted(ids)) == 0


def test_compiled_state_dict_round_trips_and_optimiser_reaches_hf():
    model = hf_model("mamba2_lm_groups")
    compiled = mambac.compile(model)
    assert set(original_state_dict(compiled)) == set(model.state_dict())
    ids = torch.randint(0, 37, (2, 8))
    before = model.lm_head.weight.detach().clone()
    opt = torch.optim.SGD(compiled.parameters(), lr=0.1)
    compiled(ids[:, :-1], ids[:, 1:]).backward()
    opt.step()
    assert not torch.equal(model.lm_head.weight, before)
    assert rel_err(compiled(ids), hf_output(model, ids)) <= 1e-5


@pytest.mark.parametrize("name", ["mamba_lm", "mamba2_lm_groups"])
def test_compiled_hf_model_generates_with_the_trained_weights(name, tmp_path):
    """``compiled.generate`` and ``save_pretrained`` are the HF model's own (the converted model has none): greedy
    generation after a training step through the compiled module matches the HF model's, which
    shares the updated parameters, and differs from before the step."""
    model = hf_model(name)
    compiled = mambac.compile(model)
    ids = torch.randint(0, 37, (1, 6))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    before = model(ids, use_cache=False).logits
    torch.optim.SGD(compiled.parameters(), lr=1.0).zero_grad()
    compiled(ids[:, :-1], ids[:, 1:]).backward()
    torch.optim.SGD(compiled.parameters(), lr=1.0).step()
    assert rel_err(model(ids, use_cache=False).logits, before) > 1e-3   # the step reached the HF model
    assert torch.equal(compiled.generate(ids, **kw), model.generate(ids, **kw))
    compiled.save_pretrained(tmp_path)   # HF's own save, of the trained weights
    assert torch.equal(type(model).from_pretrained(tmp_path).generate(ids, **kw), model.generate(ids, **kw))
    copied = copy.deepcopy(compiled)   # the copy keeps its own copy of the HF model
    assert torch.equal(copied.generate(ids, **kw), model.generate(ids, **kw))
    assert compiled.config is model.config   # the attributes of the model passed in first, then the converted one's
    assert compiled.example_inputs == compiled.original_module.example_inputs   # (HF's model has none)
    with pytest.raises(AttributeError, match=f"{type(model).__name__} nor MambaLMHeadModel"):
        compiled.no_such_attribute
    with pytest.raises(MambacInputError, match=f"converted from {type(model).__name__}: arguments .*use_cache"):
        compiled(ids, use_cache=False)   # an HF-only argument: the message says what the compiled forward takes


def test_unsupported_hf_configs_are_refused():
    with pytest.raises(MambacConfigError, match="hidden_act"):
        hf.mambac_config({"model_type": "mamba", "hidden_act": "gelu"})
    with pytest.raises(MambacConfigError, match="num_heads\\*head_dim"):
        hf.mambac_config({"model_type": "mamba2", "hidden_size": 16, "num_heads": 3, "head_dim": 8})
    with pytest.raises(MambacConfigError, match="n_groups=2 must divide num_heads=3"):
        hf.mambac_config({"model_type": "mamba2", "hidden_size": 12, "num_heads": 3, "head_dim": 8, "n_groups": 2})
    with pytest.raises(MambacConfigError, match="falcon_mamba"):
        hf.mambac_config({"model_type": "falcon_mamba"})


def test_hf_config_fields_map_onto_mambac():
    cfg = hf.mambac_config({"model_type": "mamba2", "hidden_size": 12, "num_heads": 3, "head_dim": 8, "n_groups": 3,
                            "time_step_limit": [0.01, 0.5], "layer_norm_epsilon": 1e-2, "vocab_size": 50,
                            "residual_in_fp32": False})
    assert cfg.ssm_cfg["dt_limit"] == (0.01, 0.5) and cfg.ssm_cfg["ngroups"] == 3 and cfg.ssm_cfg["headdim"] == 8
    assert cfg.ssm_cfg["norm_before_gate"] is False and cfg.padded_vocab_size == 50
    assert cfg.norm_epsilon == 1e-2 and cfg.residual_in_fp32 is False and cfg.tie_embeddings is False
    m1 = hf.mambac_config({"model_type": "mamba", "hidden_size": 40})
    assert m1.ssm_cfg["dt_rank"] == 3 and m1.tie_embeddings is True


@pytest.mark.parametrize("name", ["mamba_lm", "mamba2_lm_groups"])
def test_bf16_hf_models_compile(name):
    """An HF model loaded in bf16 (``residual_in_fp32`` on, HF's default): its conversion runs
    eagerly, and the compiled model gives bf16 logits as close to a float64 copy as HF's own bf16
    forward is."""
    import copy

    m64 = hf_model(name).double()
    model = copy.deepcopy(m64).to(torch.bfloat16)
    assert model.config.residual_in_fp32
    ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(2))
    ref, out, out_64 = hf_output(model, ids), mambac.compile(model)(ids), hf_output(m64, ids)
    assert out.dtype == torch.bfloat16
    err, err_hf = rel_err(out, out_64), rel_err(ref, out_64)
    assert err <= 3e-2 and err <= 2 * err_hf + 1e-3, (err, err_hf)
    assert rel_err(convert(model)(ids), out_64) <= 2 * err_hf + 1e-3


def test_compiled_backbone_checks_its_token_ids():
    """A converted HF backbone (no head) gets the LM's input checks: shape and vocabulary."""
    from mambac.errors import MambacInputError

    compiled = mambac.compile(hf_model("mamba2_backbone_oddheads"))
    with pytest.raises(MambacInputError, match=r"\(batch, seqlen\)"):
        compiled(torch.zeros(9, dtype=torch.int64))
    with pytest.raises(MambacInputError, match=r"outside \[0, 37\)"):
        compiled(torch.full((1, 3), 99))


def test_gradient_checkpointing_of_a_transformers_model_is_named_when_compiled():
    model = hf_model("mamba2_lm_groups").train()
    model.gradient_checkpointing_enable()
    with pytest.warns(UserWarning, match=r"Mamba2ForCausalLM has gradient checkpointing on; .* remat='full'"):
        mambac.compile(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mambac.compile(model, remat="full")
