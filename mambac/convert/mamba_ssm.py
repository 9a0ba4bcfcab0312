"""mamba_ssm models → mambac reference models.

mambac's reference models mirror mamba_ssm's constructor arguments and parameter names, so the key
map is the identity; what a converter has to recover is the configuration.  A live
``MambaLMHeadModel`` carries its ``MambaConfig``; a bare ``Mamba`` / ``Mamba2`` / ``Mamba3`` mixer
keeps its settings as attributes (and its bias choices as the presence of bias tensors).  mamba_ssm
is never imported: classes are matched by name.

Not convertible: hybrid stacks with attention layers (``attn_layer_idx``), LayerNorm blocks
(``rms_norm=False``) and tensor-parallel shards (a ``Mamba2`` built with a process group).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch.nn as nn

from mambac.convert.adopt import adopt, build_on_meta
from mambac.convert.registry import Conversion, register_converter
from mambac.errors import MambacConfigError
from mambac.models.config import MambaConfig
from mambac.models.lm import MambaLMHeadModel
from mambac.models.mamba1 import Mamba
from mambac.models.mamba2 import Mamba2


def identity(key: str) -> list[str]:
    return [key]


def mambac_config(cfg: Mapping[str, Any], norm_epsilon: float | None = None) -> MambaConfig:
    """The mambac ``MambaConfig`` of a mamba_ssm config (its fields, as a mapping).

    mamba_ssm's LM always builds its RMSNorms with eps 1e-5 (the config has no epsilon field); a
    config saved by mambac may carry ``norm_epsilon``, and ``norm_epsilon`` here overrides both.
    """
    d = dict(cfg)
    attn = d.pop("attn_layer_idx", None) or []
    d.pop("attn_cfg", None)
    if attn:
        raise MambacConfigError(f"this mamba_ssm model has attention (MHA) layers at {list(attn)}; mambac "
                                "converts stacks of Mamba layers only.")
    if norm_epsilon is not None:
        d["norm_epsilon"] = float(norm_epsilon)
    d["ssm_cfg"] = dict(d.get("ssm_cfg") or {})
    return MambaConfig.from_dict(d)


def _config_mapping(config: Any) -> dict:
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if isinstance(config, Mapping):
        return dict(config)
    return dict(vars(config))


def convert_lm(model: nn.Module) -> Conversion:
    """mamba_ssm ``MambaLMHeadModel`` → ``mambac.models.MambaLMHeadModel`` (same keys, shared tensors)."""
    eps = getattr(getattr(model.backbone, "norm_f", None), "eps", None)
    config = mambac_config(_config_mapping(model.config), norm_epsilon=eps)
    out = build_on_meta(MambaLMHeadModel, config)
    keys = adopt(out, _tensors(model), identity, what="mamba_ssm MambaLMHeadModel", live=True)
    return Conversion(out, keys, "mamba_ssm.MambaLMHeadModel")


def _tensors(model: nn.Module) -> dict:
    source = dict(model.named_parameters(remove_duplicate=False))
    source.update(model.named_buffers(remove_duplicate=False))
    return source


def _has_bias(linear: nn.Module) -> bool:
    return getattr(linear, "bias", None) is not None


def mamba1_kwargs(m: nn.Module) -> dict:
    return dict(d_model=m.d_model, d_state=m.d_state, d_conv=m.d_conv, expand=m.expand, dt_rank=m.dt_rank,
                conv_bias=_has_bias(m.conv1d), bias=_has_bias(m.in_proj), layer_idx=m.layer_idx)


def mamba2_kwargs(m: nn.Module) -> dict:
    if getattr(m, "world_size", 1) != 1:
        raise MambacConfigError(f"this mamba_ssm Mamba2 is one of {m.world_size} tensor-parallel shards; convert "
                                "the unsharded module (mambac shards it itself).")
    kw = dict(d_model=m.d_model, d_state=m.d_state, d_conv=m.d_conv, expand=m.expand, headdim=m.headdim,
              ngroups=m.ngroups, D_has_hdim=m.D_has_hdim, rmsnorm=m.rmsnorm, norm_before_gate=m.norm_before_gate,
              dt_limit=tuple(m.dt_limit), bias=_has_bias(m.in_proj), conv_bias=_has_bias(m.conv1d),
              chunk_size=m.chunk_size, layer_idx=m.layer_idx)
    if m.d_ssm != m.d_inner:
        kw["d_ssm"] = m.d_ssm
    return kw


def mamba3_kwargs(m: nn.Module) -> dict:
    kw = dict(d_model=m.d_model, d_state=m.d_state, expand=m.expand, headdim=m.headdim, ngroups=m.num_bc_heads,
              rope_fraction=2.0 / m.rotary_dim_divisor, A_floor=m.A_floor, is_outproj_norm=m.is_outproj_norm,
              is_mimo=m.is_mimo, fuse_pregate_headwise_norm=m.fuse_pregate_headwise_norm,
              chunk_size=m.chunk_size, layer_idx=m.layer_idx)
    if m.is_mimo:
        kw["mimo_rank"] = m.mimo_rank
    return kw


def _mixer_class(name: str) -> type:
    if name == "Mamba3":
        from mambac.models.mamba3 import Mamba3
        return Mamba3
    return {"Mamba": Mamba, "Mamba2": Mamba2}[name]


_SETTINGS = {"Mamba": mamba1_kwargs, "Mamba2": mamba2_kwargs, "Mamba3": mamba3_kwargs}


def convert_mixer(module: nn.Module) -> Conversion:
    """A bare mamba_ssm ``Mamba`` / ``Mamba2`` / ``Mamba3`` → the mambac mixer of the same name."""
    name = type(module).__name__
    try:
        kwargs = _SETTINGS[name](module)
    except AttributeError as exc:
        raise MambacConfigError(f"mamba_ssm {type(module).__name__} lacks an attribute mambac reads "
                                f"({exc}); is it a different mamba_ssm version?") from exc
    out = build_on_meta(_mixer_class(name), **kwargs)
    norm = getattr(module, "norm", None)
    if isinstance(out, Mamba2) and out.rmsnorm and norm is not None:
        out.norm.eps = float(norm.eps)
    keys = adopt(out, _tensors(module), identity, what=f"mamba_ssm {type(module).__name__}", live=True)
    return Conversion(out, keys, f"mamba_ssm.{type(module).__name__}")


register_converter("mamba_ssm.models.mixer_seq_simple.MambaLMHeadModel", convert_lm)
register_converter("mamba_ssm.modules.mamba_simple.Mamba", convert_mixer)
register_converter("mamba_ssm.modules.mamba2.Mamba2", convert_mixer)
register_converter("mamba_ssm.modules.mamba3.Mamba3", convert_mixer)
