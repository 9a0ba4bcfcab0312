"""Configuration of the reference LM, mirroring mamba_ssm's ``MambaConfig`` field for field.

``ssm_cfg`` holds the mixer's keyword arguments plus ``"layer"``: ``"Mamba1"``, ``"Mamba2"`` or
``"Mamba3"`` (mamba_ssm's names); missing keys take the mixer's own defaults.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mambac.errors import MambacConfigError

LAYERS = ("Mamba1", "Mamba2", "Mamba3")


@dataclass
class MambaConfig:
    d_model: int = 2560
    d_intermediate: int = 0
    n_layer: int = 64
    vocab_size: int = 50277
    ssm_cfg: dict = field(default_factory=dict)
    rms_norm: bool = True
    residual_in_fp32: bool = True
    fused_add_norm: bool = True
    pad_vocab_size_multiple: int = 8
    tie_embeddings: bool = True
    norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        layer = self.layer
        if layer not in LAYERS:
            raise MambacConfigError(f"ssm_cfg['layer'] is {layer!r}; mambac supports {list(LAYERS)}.")
        for name in ("d_model", "n_layer", "vocab_size", "pad_vocab_size_multiple"):
            if int(getattr(self, name)) <= 0:
                raise MambacConfigError(f"MambaConfig.{name} must be positive, got {getattr(self, name)}.")
        if not self.rms_norm:
            raise MambacConfigError("MambaConfig.rms_norm=False (LayerNorm blocks) is not supported by mambac; "
                                    "use rms_norm=True.")

    @property
    def layer(self) -> str:
        return self.ssm_cfg.get("layer", "Mamba1")

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_size_multiple
        return (self.vocab_size + m - 1) // m * m

    def mixer_kwargs(self) -> dict:
        return {k: v for k, v in self.ssm_cfg.items() if k != "layer"}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MambaConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise MambacConfigError(f"unknown MambaConfig fields {unknown}; known: {sorted(names)}.")
        return cls(**d)
