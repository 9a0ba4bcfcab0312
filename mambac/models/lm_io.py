"""``MambaLMHeadModel.save_pretrained`` / ``from_pretrained``: the checkpoint directory of
mamba_ssm's ``MambaLMHeadModel`` (``config.json`` with its ``MambaConfig`` fields and
``pytorch_model.bin``), so a model trained with mambac goes back to mamba_ssm, and a mamba_ssm
directory loads here, with the calls people already make.

The files are written next to their final names and renamed into place, so an interrupted save
leaves the previous checkpoint (or nothing) rather than half a file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mambac.errors import MambacInputError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "pytorch_model.bin"
DEFAULT_EPSILON = 1e-5   # the RMSNorm eps mamba_ssm's LM always builds (its config has no field for it)


def mamba_ssm_config(config) -> dict:
    """mambac's ``MambaConfig`` as mamba_ssm's ``config.json``: its fields, no attention layers, and
    ``norm_epsilon`` only where it is not mamba_ssm's fixed 1e-5 (mamba_ssm cannot read that key;
    mambac can)."""
    d = config.to_dict()
    eps = d.pop("norm_epsilon")
    d["ssm_cfg"] = dict(d["ssm_cfg"])
    d.update(attn_layer_idx=[], attn_cfg={})
    if eps != DEFAULT_EPSILON:
        d["norm_epsilon"] = eps
    return d


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_pretrained(model, save_directory: str | os.PathLike) -> Path:
    """Write ``model``'s config and weights (as they are: dtype and values) to ``save_directory``."""
    directory = Path(save_directory)
    if directory.exists() and not directory.is_dir():
        raise MambacInputError(f"{str(directory)!r} is a file; save_pretrained writes a directory "
                               f"({CONFIG_NAME} and {WEIGHTS_NAME}): pass a directory path.")
    config = mamba_ssm_config(model.config)   # before anything is written: a bad config stops here
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    _write_atomically(directory / WEIGHTS_NAME, lambda p: torch.save(state, p))
    _write_atomically(directory / CONFIG_NAME, lambda p: p.write_text(json.dumps(config, indent=4) + "\n"))
    return directory


def from_pretrained(cls, pretrained_model_name: str | os.PathLike, device=None, dtype=None):
    """A local checkpoint directory (mamba_ssm's or Hugging Face's layout) as a ``cls``; loaded on
    ``device`` (default: the CPU) and cast to ``dtype`` when given."""
    from mambac.convert.pretrained import from_pretrained as load
    model = load(pretrained_model_name, dtype=dtype, device="cpu" if device is None else device)
    if not isinstance(model, cls):
        raise MambacInputError(f"{str(pretrained_model_name)!r} holds a {type(model).__name__} (a backbone "
                               f"without an LM head), not a {cls.__name__}; load it with mambac.from_pretrained.")
    return model
