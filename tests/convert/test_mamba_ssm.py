"""mamba_ssm converters on the CPU, with stand-ins: mambac's reference classes re-labelled with
mamba_ssm's qualified class names.  They carry the attributes and parameter names of mamba_ssm's
modules (the reference models mirror them), so they exercise reading the configuration back from
a live module.  The real mamba_ssm modules are compared in test_mamba_ssm_gpu.py (GPU tier)."""
import pytest
import torch

from mambac.convert import convert, original_state_dict
from mambac.errors import MambacConfigError
from mambac.models import Mamba, Mamba2, MambaConfig, MambaLMHeadModel
from mambac.models.mamba3 import Mamba3
from tests.helpers import rel_err


def standin(base: type, module: str, name: str) -> type:
    return type(name, (base,), {"__module__": module, "__qualname__": name})


SsmMamba = standin(Mamba, "mamba_ssm.modules.mamba_simple", "Mamba")
SsmMamba2 = standin(Mamba2, "mamba_ssm.modules.mamba2", "Mamba2")
SsmMamba3 = standin(Mamba3, "mamba_ssm.modules.mamba3", "Mamba3")
SsmLM = standin(MambaLMHeadModel, "mamba_ssm.models.mixer_seq_simple", "MambaLMHeadModel")

MIXERS = {
    "mamba1_bias_rank": (SsmMamba, Mamba, dict(d_state=4, dt_rank=3, bias=True, conv_bias=False, d_conv=3)),
    "mamba2_groups_side_mlp": (SsmMamba2, Mamba2, dict(d_state=8, headdim=8, ngroups=2, d_ssm=16, chunk_size=4,
                                                       norm_before_gate=True, dt_limit=(0.01, 0.4))),
    "mamba2_hdimD_nonorm_bias": (SsmMamba2, Mamba2, dict(d_state=6, headdim=4, D_has_hdim=True, rmsnorm=False,
                                                         bias=True, chunk_size=3)),
    "mamba3_siso_outnorm": (SsmMamba3, Mamba3, dict(d_state=8, headdim=8, ngroups=2, is_outproj_norm=True,
                                                    rope_fraction=1.0, chunk_size=4)),
    "mamba3_mimo": (SsmMamba3, Mamba3, dict(d_state=8, headdim=8, is_mimo=True, mimo_rank=2, chunk_size=4)),
}


def _perturb(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_bare_mixer_converts_with_its_settings(name):
    cls, target, kw = MIXERS[name]
    module = cls(16, layer_idx=3, **kw)
    _perturb(module)
    if isinstance(module, Mamba2) and module.rmsnorm:
        module.norm.eps = 1e-2
    converted = convert(module)
    assert type(converted) is target and converted.layer_idx == 3
    assert {id(p) for p in converted.parameters()} == {id(p) for p in module.parameters()}
    assert list(original_state_dict(converted)) == list(module.state_dict())
    x = torch.randn(2, 7, 16)
    assert rel_err(converted(x), module(x)) == 0


def test_lm_converts_with_its_config_and_norm_epsilon():
    config = MambaConfig(d_model=16, n_layer=2, vocab_size=37, d_intermediate=24, tie_embeddings=False,
                         norm_epsilon=1e-3, ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4))
    torch.manual_seed(0)
    model = SsmLM(config)
    _perturb(model)
    converted = convert(model)
    assert type(converted) is MambaLMHeadModel and converted.config == config
    assert {id(p) for p in converted.parameters()} == {id(p) for p in model.parameters()}
    ids = torch.randint(0, 37, (2, 6))
    assert rel_err(converted(ids), model(ids)) == 0


def test_sharded_mamba2_is_refused():
    module = SsmMamba2(16, d_state=8, headdim=8)
    module.world_size = 2
    with pytest.raises(MambacConfigError, match="tensor-parallel"):
        convert(module)
