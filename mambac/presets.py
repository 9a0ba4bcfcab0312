"""Built-in model presets, by name (used by the CLI and the examples)."""
from __future__ import annotations

from typing import Callable

import torch

from mambac.errors import MambacInputError
from mambac.models.config import MambaConfig
from mambac.models.lm import MambaLMHeadModel

_M2_TINY = dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=16)

PRESETS: dict[str, dict] = {
    "mamba1-tiny": dict(d_model=64, n_layer=2, vocab_size=64, ssm_cfg=dict(layer="Mamba1", d_state=8)),
    "mamba2-tiny": dict(d_model=64, n_layer=2, vocab_size=64, ssm_cfg=dict(_M2_TINY)),
    "mamba3-tiny": dict(d_model=64, n_layer=2, vocab_size=64,
                        ssm_cfg=dict(layer="Mamba3", d_state=16, headdim=16, chunk_size=16)),
    "mamba2-130m": dict(d_model=768, n_layer=24, vocab_size=50277, pad_vocab_size_multiple=16,
                        ssm_cfg=dict(layer="Mamba2", d_state=128, headdim=64, chunk_size=256)),
}


def preset_config(name: str) -> MambaConfig:
    if name not in PRESETS:
        raise MambacInputError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}.")
    return MambaConfig(**PRESETS[name])


def build_preset(name: str, seed: int = 0, device=None, dtype=None) -> MambaLMHeadModel:
    """A random-weight model of the named preset."""
    cfg = preset_config(name)
    torch.manual_seed(seed)
    return MambaLMHeadModel(cfg, device=device, dtype=dtype)


def preset_names() -> list[str]:
    return sorted(PRESETS)


Factory = Callable[[], torch.nn.Module]
