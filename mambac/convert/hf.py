"""Hugging Face ``transformers`` Mamba / Mamba-2 models → mambac reference models.

Works from a config *mapping* (a live model's ``config.to_dict()`` or a ``config.json``), so loading
a checkpoint never imports transformers.  How HF's (plain PyTorch) forward maps onto mambac:

* Mamba (``model_type="mamba"``): ``in_proj → conv → x_proj → dt_proj → selective scan → D skip →
  silu(z) gate → out_proj``, the same math and parameter names as mamba_ssm's ``Mamba``;
  ``time_step_rank`` is the ``dt_rank``, ``use_bias`` the in/out projection bias, ``use_conv_bias``
  the conv bias.
* Mamba-2 (``model_type="mamba2"``): in_proj splits ``[z | xBC | dt]`` (no gated-MLP side branch:
  HF requires ``num_heads*head_dim == expand*hidden_size``), dt is ``softplus(dt + dt_bias)``
  clamped to ``time_step_limit``, D is per head, and the output goes through HF's gated RMSNorm,
  which *always* gates first (``norm(y * silu(z))``, i.e. mamba_ssm's ``norm_before_gate=False``),
  normalises ``n_groups`` groups of ``expand*hidden_size/n_groups`` features (transformers 5.17 and
  older normalise the whole width: a live model is matched as it computes, see ``_copy_live_norms``),
  and uses ``layer_norm_epsilon`` (mamba_ssm hard-codes 1e-5: the converter sets the norm's ``eps``).
  Old ``rms_norm`` / ``norm_before_gate`` config keys are ignored, as HF ignores them.
* Blocks: HF's ``h + mixer(norm(h))`` with an fp32 residual stream (``residual_in_fp32``) is
  mambac's add-then-norm block; the final ``norm_f`` and the LM head follow.  The vocabulary is not
  padded (``pad_vocab_size_multiple=1``); the head is tied when HF ties it.
* ``embeddings`` (HF) is ``embedding`` in mambac: the only renamed key.

``hidden_act`` other than ``"silu"`` has no mambac equivalent and is refused.

``convert_mixer`` converts one live ``MambaMixer`` / ``Mamba2Mixer`` on its own, from its
attributes (the ``torch.compile`` backend swaps HF mixers inside dynamo graphs with it).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch.nn as nn

from mambac.convert.adopt import adopt, build_on_meta
from mambac.convert.registry import Conversion, register_converter
from mambac.errors import MambacConfigError
from mambac.models.config import MambaConfig
from mambac.models.lm import MambaLMHeadModel, MixerModel
from mambac.models.mamba2 import Mamba2

# Defaults of transformers' config classes: a saved config.json may leave out default values.
MAMBA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50280, hidden_size=768, state_size=16, num_hidden_layers=32, layer_norm_epsilon=1e-5,
    expand=2, conv_kernel=4, use_bias=False, use_conv_bias=True, hidden_act="silu", residual_in_fp32=True,
    time_step_rank="auto", time_step_scale=1.0, time_step_min=0.001, time_step_max=0.1,
    time_step_init_scheme="random", time_step_floor=1e-4, tie_word_embeddings=True)
MAMBA2_DEFAULTS: dict[str, Any] = dict(
    num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128, num_hidden_layers=64,
    layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, n_groups=8, use_bias=False, use_conv_bias=True,
    hidden_act="silu", residual_in_fp32=True, time_step_min=0.001, time_step_max=0.1, time_step_floor=1e-4,
    time_step_limit=(0.0, float("inf")), chunk_size=256, tie_word_embeddings=False)
MODEL_TYPES = ("mamba", "mamba2")


def _settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    kind = cfg.get("model_type")
    if kind not in MODEL_TYPES:
        raise MambacConfigError(f"Hugging Face model_type {kind!r} is not supported; mambac converts {list(MODEL_TYPES)}.")
    full = dict(MAMBA_DEFAULTS if kind == "mamba" else MAMBA2_DEFAULTS)
    full.update({k: v for k, v in cfg.items() if v is not None or k not in full})
    if full["hidden_act"] != "silu":
        raise MambacConfigError(f"hidden_act={full['hidden_act']!r}: mambac's Mamba blocks use SiLU only.")
    return full


def _mamba1_cfg(c: dict) -> dict:
    rank = c["time_step_rank"]
    ssm = dict(layer="Mamba1", d_state=c["state_size"], d_conv=c["conv_kernel"], expand=c["expand"],
               dt_rank=math.ceil(c["hidden_size"] / 16) if rank == "auto" else int(rank),
               dt_min=c["time_step_min"], dt_max=c["time_step_max"], dt_scale=c["time_step_scale"],
               dt_init_floor=c["time_step_floor"], conv_bias=c["use_conv_bias"], bias=c["use_bias"])
    if c["time_step_init_scheme"] in ("random", "constant"):
        ssm["dt_init"] = c["time_step_init_scheme"]
    return ssm


def _mamba2_cfg(c: dict) -> dict:
    d_inner = int(c["expand"] * c["hidden_size"])
    if c["num_heads"] * c["head_dim"] != d_inner:
        raise MambacConfigError(f"Mamba-2 config: num_heads*head_dim = {c['num_heads'] * c['head_dim']} must equal "
                                f"expand*hidden_size = {d_inner}.")
    if c["num_heads"] % c["n_groups"]:
        raise MambacConfigError(f"Mamba-2 config: n_groups={c['n_groups']} must divide num_heads={c['num_heads']}.")
    return dict(layer="Mamba2", d_state=c["state_size"], d_conv=c["conv_kernel"], expand=c["expand"],
                headdim=c["head_dim"], ngroups=c["n_groups"], rmsnorm=True, norm_before_gate=False,
                dt_min=c["time_step_min"], dt_max=c["time_step_max"], dt_init_floor=c["time_step_floor"],
                dt_limit=tuple(float(x) for x in c["time_step_limit"]), bias=c["use_bias"],
                conv_bias=c["use_conv_bias"], chunk_size=c["chunk_size"])


def mambac_config(cfg: Mapping[str, Any], *, vocab_rows: int | None = None, tied: bool | None = None) -> MambaConfig:
    """The ``MambaConfig`` equivalent to a HF Mamba / Mamba-2 config mapping.  ``vocab_rows`` (the
    embedding's actual row count) and ``tied`` (whether the head is the embedding) override the
    config when known from a live model or a checkpoint."""
    c = _settings(cfg)
    ssm = _mamba1_cfg(c) if c["model_type"] == "mamba" else _mamba2_cfg(c)
    return MambaConfig(d_model=c["hidden_size"], d_intermediate=0, n_layer=c["num_hidden_layers"],
                       vocab_size=int(vocab_rows or c["vocab_size"]), ssm_cfg=ssm, rms_norm=True,
                       residual_in_fp32=bool(c["residual_in_fp32"]), pad_vocab_size_multiple=1,
                       tie_embeddings=bool(c["tie_word_embeddings"] if tied is None else tied),
                       norm_epsilon=float(c["layer_norm_epsilon"]))


def build(config: MambaConfig, cfg: Mapping[str, Any], *, with_head: bool) -> nn.Module:
    """A meta-device mambac LM (or bare backbone) for ``config``, with HF's mixer-norm epsilon."""
    model = build_on_meta(MambaLMHeadModel, config) if with_head else build_on_meta(MixerModel, config)
    if config.layer == "Mamba2":
        eps = float(_settings(cfg)["layer_norm_epsilon"])
        for mixer in _mamba2_mixers(model):
            mixer.norm.eps = eps
    return model


def _mamba2_mixers(model: nn.Module) -> list[Mamba2]:
    return [m for m in model.modules() if isinstance(m, Mamba2) and m.rmsnorm]


def _copy_live_norms(out: nn.Module, model: nn.Module) -> None:
    """Take each Mamba-2 gated norm's epsilon and grouping from the live HF layer it replaces.

    transformers releases differ here: recent ones normalise ``n_groups`` groups (as mamba_ssm
    does), older ones (5.17 and before) the whole width at once.  A live model is matched as it
    computes; a checkpoint loads with the grouped norm."""
    theirs = [m.norm for m in model.modules() if type(m).__name__ == "Mamba2Mixer"]
    for ours, norm in zip(_mamba2_mixers(out), theirs):
        ours.norm.eps = float(norm.variance_epsilon)
        ours.norm.group_size = int(getattr(norm, "group_size", norm.weight.shape[0]))


def candidates(key: str) -> list[str]:
    """HF names of a mambac key: ``embedding`` is ``embeddings`` in HF (older files used ``embedding``)."""
    if key == "embedding.weight" or key.endswith(".embedding.weight"):
        return [key.replace("embedding.weight", "embeddings.weight"), key]
    return [key]


def _convert_live(model: nn.Module, with_head: bool) -> Conversion:
    backbone = model.backbone if with_head else model
    rows = backbone.embeddings.weight.shape[0]
    tied = model.lm_head.weight is backbone.embeddings.weight if with_head else None
    cfg = model.config.to_dict()
    out = build(mambac_config(cfg, vocab_rows=rows, tied=tied), cfg, with_head=with_head)
    _copy_live_norms(out, model)
    source = dict(model.named_parameters(remove_duplicate=False))
    source.update(model.named_buffers(remove_duplicate=False))
    keys = adopt(out, source, candidates, what=f"{type(model).__name__} (transformers)", live=True)
    return Conversion(out, keys, f"transformers.{type(model).__name__}")


def convert_causal_lm(model: nn.Module) -> Conversion:
    """``MambaForCausalLM`` / ``Mamba2ForCausalLM`` → ``mambac.models.MambaLMHeadModel``."""
    return _convert_live(model, with_head=True)


def convert_backbone(model: nn.Module) -> Conversion:
    """``MambaModel`` / ``Mamba2Model`` → ``mambac.models.lm.MixerModel`` (returns the final hidden states)."""
    return _convert_live(model, with_head=False)


for _family, _mod in (("mamba", "Mamba"), ("mamba2", "Mamba2")):
    register_converter(f"transformers.models.{_family}.modeling_{_family}.{_mod}ForCausalLM", convert_causal_lm)
    register_converter(f"transformers.models.{_family}.modeling_{_family}.{_mod}Model", convert_backbone)


# -- one mixer ----------------------------------------------------------------------------------------

def _expand(mixer: nn.Module) -> int:
    width, d_model = int(mixer.intermediate_size), int(mixer.hidden_size)
    if width % d_model:
        raise MambacConfigError(f"{type(mixer).__name__}: intermediate_size={width} is not a multiple of "
                                f"hidden_size={d_model}; mambac's mixers take an integer expand.")
    return width // d_model


def _check_silu(mixer: nn.Module) -> None:
    if getattr(mixer, "activation", "silu") != "silu":
        raise MambacConfigError(f"{type(mixer).__name__}: hidden_act={mixer.activation!r}: mambac's Mamba "
                                "blocks use SiLU only.")


def _mixer_mamba1(mixer: nn.Module) -> nn.Module:
    from mambac.models.mamba1 import Mamba
    return build_on_meta(Mamba, d_model=int(mixer.hidden_size), d_state=int(mixer.ssm_state_size),
                         d_conv=int(mixer.conv_kernel_size), expand=_expand(mixer), dt_rank=int(mixer.time_step_rank),
                         conv_bias=mixer.conv1d.bias is not None, bias=mixer.in_proj.bias is not None,
                         layer_idx=mixer.layer_idx)


def _mixer_mamba2(mixer: nn.Module) -> nn.Module:
    if mixer.num_heads * mixer.head_dim != mixer.intermediate_size:
        raise MambacConfigError(f"Mamba2Mixer: num_heads*head_dim = {mixer.num_heads * mixer.head_dim} must equal "
                                f"intermediate_size = {mixer.intermediate_size}.")
    if mixer.num_heads % mixer.n_groups:
        raise MambacConfigError(f"Mamba2Mixer: n_groups={mixer.n_groups} must divide num_heads={mixer.num_heads}.")
    out = build_on_meta(Mamba2, d_model=int(mixer.hidden_size), d_state=int(mixer.ssm_state_size),
                        d_conv=int(mixer.conv_kernel_size), expand=_expand(mixer), headdim=int(mixer.head_dim),
                        ngroups=int(mixer.n_groups), rmsnorm=True, norm_before_gate=False,
                        dt_limit=tuple(float(x) for x in mixer.time_step_limit), bias=mixer.in_proj.bias is not None,
                        conv_bias=mixer.conv1d.bias is not None, chunk_size=int(mixer.chunk_size),
                        layer_idx=mixer.layer_idx)
    out.norm.eps = float(mixer.norm.variance_epsilon)
    out.norm.group_size = int(getattr(mixer.norm, "group_size", mixer.norm.weight.shape[0]))
    return out


_MIXERS = {"MambaMixer": _mixer_mamba1, "Mamba2Mixer": _mixer_mamba2}


def convert_mixer(mixer: nn.Module) -> Conversion:
    """One live HF ``MambaMixer`` / ``Mamba2Mixer`` → mambac's ``Mamba`` / ``Mamba2`` holding the same
    parameters, its settings read from the mixer's attributes (what ``torch.compile``'s backend
    swaps in for each HF mixer of a dynamo graph).  An unsupported setting is a ``MambacConfigError``."""
    build_mixer = _MIXERS.get(type(mixer).__name__)
    if build_mixer is None:
        raise MambacConfigError(f"{type(mixer).__name__} is not a transformers MambaMixer or Mamba2Mixer.")
    _check_silu(mixer)
    try:
        out = build_mixer(mixer)
    except AttributeError as exc:
        raise MambacConfigError(f"transformers {type(mixer).__name__} lacks an attribute mambac reads ({exc}); "
                                "is it a different transformers version?") from exc
    source = dict(mixer.named_parameters(remove_duplicate=False))
    source.update(mixer.named_buffers(remove_duplicate=False))
    keys = adopt(out, source, candidates, what=f"{type(mixer).__name__} (transformers)", live=True)
    return Conversion(out, keys, f"transformers.{type(mixer).__name__}")
