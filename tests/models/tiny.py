"""Tiny random-weight configurations of every model family, for the tests."""
from __future__ import annotations

import torch

from mambac.models import MambaConfig, MambaLMHeadModel

MAMBA2 = dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4)
VARIANTS = {
    "mamba1": dict(ssm_cfg=dict(layer="Mamba1", d_state=4)),
    "mamba2": dict(ssm_cfg=dict(MAMBA2)),
    "mamba2_groups_hdimD_nonorm_limit": dict(ssm_cfg=dict(MAMBA2, ngroups=2, D_has_hdim=True, rmsnorm=False,
                                                          dt_limit=(0.01, 0.5))),
    "mamba2_oddheads_normbeforegate_mlp": dict(d_model=24, d_intermediate=40,
                                               ssm_cfg=dict(MAMBA2, norm_before_gate=True)),
    "mamba2_dssm_side_mlp": dict(ssm_cfg=dict(MAMBA2, d_ssm=32)),
    "mamba3_siso": dict(ssm_cfg=dict(layer="Mamba3", d_state=8, headdim=8, chunk_size=4)),
    "mamba3_mimo_outnorm": dict(d_model=24, ssm_cfg=dict(layer="Mamba3", d_state=8, headdim=8, chunk_size=4,
                                                         is_mimo=True, mimo_rank=2, is_outproj_norm=True)),
}


def tiny_lm(name: str, seed: int = 0, **over) -> MambaLMHeadModel:
    kw = dict(d_model=32, n_layer=2, vocab_size=37, pad_vocab_size_multiple=8)
    kw.update(VARIANTS[name])
    kw.update(over)
    torch.manual_seed(seed)
    return MambaLMHeadModel(MambaConfig(**kw))
