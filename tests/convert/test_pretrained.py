"""mambac.from_pretrained: Hugging Face and mamba_ssm checkpoint directories, single-file and sharded,
safetensors and .bin; mismatching checkpoints fail naming the key."""
import json

import pytest
import torch
from safetensors.torch import save_file

import mambac
from mambac.convert import original_state_dict
from mambac.errors import MambacConfigError, MambacInputError
from mambac.models import MambaConfig, MambaLMHeadModel
from mambac.models.lm import MixerModel
from tests.convert.hf_models import checkpoint_reference, hf_model, hf_output
from tests.helpers import rel_err

MAMBA_SSM_FIELDS = ("d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "rms_norm", "residual_in_fp32",
                    "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings")
MIXER_KEYS = {  # parameter names of mamba_ssm's mixers (modules/mamba_simple.py, mamba2.py, mamba3.py)
    "Mamba1": {"in_proj.weight", "conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight", "dt_proj.bias",
               "A_log", "D", "out_proj.weight"},
    "Mamba2": {"in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight",
               "out_proj.weight"},
    "Mamba3": {"in_proj.weight", "dt_bias", "B_bias", "C_bias", "B_norm.weight", "C_norm.weight", "D",
               "out_proj.weight"},
}
SSM_CASES = {
    "Mamba1": dict(d_intermediate=0, ssm_cfg=dict(layer="Mamba1", d_state=4)),
    "Mamba2": dict(d_intermediate=40, ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, ngroups=2, chunk_size=4)),
    "Mamba3": dict(d_intermediate=0, tie_embeddings=False, ssm_cfg=dict(layer="Mamba3", d_state=8, headdim=8, chunk_size=4)),
}


def _ids():
    return torch.randint(0, 37, (2, 7))


def write_mamba_ssm_dir(model: MambaLMHeadModel, path) -> None:
    """Write ``model`` the way mamba_ssm's ``MambaLMHeadModel.save_pretrained`` does: its config's
    fields (mamba_ssm's MambaConfig has no norm_epsilon; it has the attention fields) and
    ``torch.save(state_dict())`` as pytorch_model.bin."""
    path.mkdir(exist_ok=True)
    cfg = {k: getattr(model.config, k) for k in MAMBA_SSM_FIELDS}
    cfg.update(attn_layer_idx=[], attn_cfg={})
    (path / "config.json").write_text(json.dumps(cfg, indent=4))
    torch.save(model.state_dict(), path / "pytorch_model.bin")


def ssm_lm(layer: str, seed: int = 0) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    return MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=37, **SSM_CASES[layer]))


@pytest.mark.parametrize("layer", sorted(SSM_CASES))
def test_mamba_ssm_directory_loads(layer, tmp_path):
    model = ssm_lm(layer)
    mixer_keys = {k.split("mixer.", 1)[1] for k in model.state_dict() if ".layers.0.mixer." in k}
    assert MIXER_KEYS[layer] <= mixer_keys  # Mamba3 adds the optional norm / MIMO weights only when configured
    write_mamba_ssm_dir(model, tmp_path)
    loaded = mambac.from_pretrained(tmp_path)
    assert isinstance(loaded, MambaLMHeadModel) and loaded.config == model.config
    ids = _ids()
    assert rel_err(loaded(ids), model(ids)) == 0
    assert list(original_state_dict(loaded)) == list(model.state_dict())
    assert (loaded.lm_head.weight is loaded.backbone.embedding.weight) == model.config.tie_embeddings


@pytest.mark.parametrize("name", ["mamba_lm", "mamba2_lm_groups"])
def test_hf_safetensors_directory_loads(name, tmp_path):
    model = hf_model(name)
    model.save_pretrained(tmp_path)
    loaded = mambac.from_pretrained(str(tmp_path))
    ids = _ids()
    assert rel_err(loaded(ids), checkpoint_reference(model, ids)) <= 1e-6
    assert set(original_state_dict(loaded)) == set(model.state_dict())


def test_hf_sharded_safetensors_and_compile_from_path(tmp_path):
    model = hf_model("mamba2_lm_oddheads")
    model.save_pretrained(tmp_path, max_shard_size="2KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    compiled = mambac.compile(tmp_path)
    ids = _ids()
    assert rel_err(compiled(ids), checkpoint_reference(model, ids)) <= 1e-5


def test_hf_backbone_directory_loads_as_mixer_model(tmp_path):
    model = hf_model("mamba2_backbone_oddheads")
    model.save_pretrained(tmp_path)
    loaded = mambac.from_pretrained(tmp_path)
    ids = _ids()
    assert isinstance(loaded, MixerModel)
    assert rel_err(loaded(ids), checkpoint_reference(model, ids)) <= 1e-6


def _write_bin_shards(sd: dict, path, n: int = 3) -> None:
    keys = sorted(sd)
    weight_map = {}
    for i in range(n):
        name = f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin"
        part = {k: sd[k] for k in keys[i::n]}
        torch.save(part, path / name)
        weight_map.update({k: name for k in part})
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_bin_directories_load(sharded, tmp_path):
    model = hf_model("mamba_lm_quirks")
    model.config.save_pretrained(tmp_path)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if sharded:
        _write_bin_shards(sd, tmp_path)
    else:
        torch.save(sd, tmp_path / "pytorch_model.bin")
    loaded = mambac.from_pretrained(tmp_path, dtype=torch.float64)
    assert all(p.dtype == torch.float64 for p in loaded.parameters())
    ids = _ids()
    assert rel_err(loaded(ids), hf_output(model, ids)) <= 1e-5


def _hf_dir(tmp_path, name="mamba_lm"):
    model = hf_model(name)
    model.save_pretrained(tmp_path)
    return model, (tmp_path / "model.safetensors")


def _rewrite(file, change) -> None:
    from safetensors.torch import load_file
    sd = load_file(str(file))
    change(sd)
    save_file(sd, str(file))


def test_missing_tensor_is_named(tmp_path):
    _, file = _hf_dir(tmp_path)
    _rewrite(file, lambda sd: sd.pop("backbone.layers.1.mixer.dt_proj.bias"))
    with pytest.raises(MambacInputError, match="'backbone.layers.1.mixer.dt_proj.bias'"):
        mambac.from_pretrained(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    _, file = _hf_dir(tmp_path)
    _rewrite(file, lambda sd: sd.update({"backbone.layers.0.mixer.A_log": torch.zeros(32, 5)}))
    with pytest.raises(MambacInputError, match=r"'backbone.layers.0.mixer.A_log' has shape \(32, 5\).*\(32, 4\)"):
        mambac.from_pretrained(tmp_path)


def test_unexpected_tensor_is_named(tmp_path):
    _, file = _hf_dir(tmp_path)
    _rewrite(file, lambda sd: sd.update({"backbone.layers.0.mixer.extra": torch.zeros(3)}))
    with pytest.raises(MambacInputError, match="backbone.layers.0.mixer.extra"):
        mambac.from_pretrained(tmp_path)


def test_missing_untied_head_is_named(tmp_path):
    model = hf_model("mamba2_lm_groups")  # untied: the head must be in the file
    model.save_pretrained(tmp_path)
    _rewrite(tmp_path / "model.safetensors", lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(MambacInputError, match="'lm_head.weight'"):
        mambac.from_pretrained(tmp_path)


def test_bad_directories_are_refused(tmp_path):
    with pytest.raises(MambacInputError, match="not a directory"):
        mambac.from_pretrained(tmp_path / "nope")
    with pytest.raises(MambacInputError, match="nn.Module or the path"):
        mambac.compile(str(tmp_path / "nope"))
    with pytest.raises(MambacInputError, match="no config.json"):
        mambac.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(MambacInputError, match="holds no weights"):
        mambac.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_text("not a checkpoint")
    with pytest.raises(MambacInputError, match="cannot read"):
        mambac.from_pretrained(tmp_path)


@pytest.mark.parametrize("cfg, match", [
    ({"hidden": 8}, "neither"),
    ({"model_type": "llama"}, "'llama' is not supported"),
    ({"model_type": "falcon_mamba", "hidden_size": 8}, "falcon_mamba"),
    ({"d_model": 8, "n_layer": 1, "vocab_size": 5, "attn_layer_idx": [0], "attn_cfg": {}}, "attention"),
    ({"d_model": 8, "n_layer": 1, "vocab_size": 5, "rms_norm": False}, "rms_norm=False"),
])
def test_unsupported_configs_are_refused(cfg, match, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(MambacConfigError, match=match):
        mambac.from_pretrained(tmp_path)
