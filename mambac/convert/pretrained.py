"""``mambac.from_pretrained(path)``: a local checkpoint directory → a mambac reference model.

Two layouts are read, neither needing transformers or mamba_ssm:

* Hugging Face: ``config.json`` with ``model_type`` ``"mamba"`` or ``"mamba2"``, weights in
  ``model.safetensors``, ``pytorch_model.bin`` or their sharded forms (``*.index.json`` naming the
  shard of every tensor).  Keys under ``backbone.`` give an LM; bare keys (a saved ``MambaModel``)
  give the backbone alone (``MixerModel``).
* mamba_ssm: ``config.json`` with mamba_ssm's ``MambaConfig`` fields (``d_model``, ``n_layer``,
  ``ssm_cfg``, ...) and ``pytorch_model.bin`` (or the same safetensors / sharded files).

The model is built on the meta device and the loaded tensors become its parameters, so nothing is
initialised or copied.  A tensor the configuration needs but the files lack, one they hold but the
configuration does not use, or one of the wrong shape is a ``MambacInputError`` naming the key.
The result remembers the checkpoint's key names: ``mambac.convert.original_state_dict(model)``
gives the state dict back in the file's naming.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from mambac.convert import hf, mamba_ssm
from mambac.convert.adopt import adopt, build_on_meta
from mambac.convert.registry import attach
from mambac.errors import MambacConfigError, MambacInputError
from mambac.models.lm import MambaLMHeadModel

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _decode(value: Any) -> Any:
    """JSON as transformers writes it: non-finite floats may be ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def read_config(directory: Path) -> dict:
    path = directory / "config.json"
    if not path.is_file():
        raise MambacInputError(f"{directory} has no config.json; mambac.from_pretrained needs a Hugging Face "
                               "or mamba_ssm checkpoint directory.")
    try:
        return _decode(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise MambacInputError(f"{path} is not valid JSON: {exc}") from exc


def _load_file(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(str(path), device=str(device))
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # pickle, zip and weights_only errors all mean "not a plain state dict"
        raise MambacInputError(f"cannot read {path} as a PyTorch state dict: {exc}") from exc


def _load_sharded(index: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise MambacInputError(f"{index} has no 'weight_map'; it is not a sharded checkpoint index.")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (index.parent / shard).is_file():
            raise MambacInputError(f"{index} names shard '{shard}', which is not in {index.parent}.")
        tensors.update(_load_file(index.parent / shard, device))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise MambacInputError(f"{index} maps {missing[:8]} to shards that do not hold them.")
    return tensors


def load_tensors(directory: Path, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], str]:
    """Every tensor of the checkpoint in ``directory`` and the file (or index) it came from."""
    for name in WEIGHT_FILES:
        path = directory / name
        if path.is_file():
            loaded = _load_sharded(path, device) if name.endswith(".index.json") else _load_file(path, device)
            return loaded, name
    raise MambacInputError(f"{directory} holds no weights: expected one of {list(WEIGHT_FILES)}.")


def _build(cfg: dict, tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, Any, str]:
    """(meta model, candidate-name function, format name) for a config and its tensors."""
    if "model_type" in cfg:
        with_head = any(k.startswith("backbone.") for k in tensors)
        config = hf.mambac_config(cfg)
        return hf.build(config, cfg, with_head=with_head), hf.candidates, f"Hugging Face {cfg['model_type']}"
    if "d_model" in cfg and "n_layer" in cfg:
        config = mamba_ssm.mambac_config(cfg)
        return build_on_meta(MambaLMHeadModel, config), mamba_ssm.identity, "mamba_ssm"
    raise MambacConfigError("config.json is neither a Hugging Face Mamba config (model_type 'mamba' or "
                            "'mamba2') nor a mamba_ssm MambaConfig (d_model, n_layer, ssm_cfg, ...).")


def from_pretrained(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> nn.Module:
    """Load the checkpoint directory ``path`` (Hugging Face or mamba_ssm layout) as a mambac model.

    ``device`` is where tensors are loaded; ``dtype`` (optional) casts every floating-point tensor.
    Returns a ``MambaLMHeadModel`` (or a ``MixerModel`` for a saved HF backbone without head).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise MambacInputError(f"{str(path)!r} is not a directory; mambac.from_pretrained reads local checkpoint "
                               "directories (download a hub model first, e.g. huggingface_hub.snapshot_download).")
    cfg = read_config(directory)
    tensors, filename = load_tensors(directory, device)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    model, candidates, fmt = _build(cfg, tensors)
    keys = adopt(model, tensors, candidates, what=f"checkpoint {directory / filename}")
    attach(model, keys, f"{fmt} checkpoint {directory}")
    return model
