import pytest
import torch

from mambac.errors import MambacConfigError
from mambac.models import Mamba, Mamba2, MambaConfig, MambaLMHeadModel


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=30, headdim=8), "headdim=8 must divide d_ssm=60"),
    (dict(d_model=32, headdim=8, ngroups=3), "ngroups=3 must divide the head count 8"),
    (dict(d_model=32, headdim=8, dt_limit=(1.0, 0.5)), "dt_limit"),
])
def test_mamba2_config_errors(kwargs, match):
    with pytest.raises(MambacConfigError, match=match):
        Mamba2(**kwargs)


def test_lm_config_errors():
    with pytest.raises(MambacConfigError, match="supports"):
        MambaConfig(ssm_cfg={"layer": "Mamba9"})
    with pytest.raises(MambacConfigError, match="unknown MambaConfig fields"):
        MambaConfig.from_dict({"d_model": 8, "n_layers": 2})


def test_state_dict_names_follow_mamba_ssm():
    m = MambaLMHeadModel(MambaConfig(d_model=16, n_layer=1, vocab_size=10, d_intermediate=32,
                                     ssm_cfg=dict(layer="Mamba2", d_state=4, headdim=8, chunk_size=4)))
    keys = set(m.state_dict())
    for k in ["backbone.embedding.weight", "backbone.layers.0.norm.weight", "backbone.layers.0.mixer.in_proj.weight",
              "backbone.layers.0.mixer.conv1d.weight", "backbone.layers.0.mixer.conv1d.bias",
              "backbone.layers.0.mixer.dt_bias", "backbone.layers.0.mixer.A_log", "backbone.layers.0.mixer.D",
              "backbone.layers.0.mixer.norm.weight", "backbone.layers.0.mixer.out_proj.weight",
              "backbone.layers.0.norm2.weight", "backbone.layers.0.mlp.fc1.weight", "backbone.layers.0.mlp.fc2.weight",
              "backbone.norm_f.weight", "lm_head.weight"]:
        assert k in keys, k
    assert m.lm_head.weight is m.backbone.embedding.weight
    assert m.backbone.embedding.weight.shape[0] == 16  # vocab 10 padded to a multiple of 8


def test_mamba1_shapes_follow_mamba_ssm():
    m = Mamba(d_model=16, d_state=4)
    assert m.x_proj.weight.shape == (1 + 8, 32) and m.dt_proj.weight.shape == (32, 1)
    assert m.A_log.shape == (32, 4) and torch.allclose(m.A_log.exp()[0], torch.arange(1.0, 5.0))
