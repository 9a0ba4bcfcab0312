"""Converters: models people already have → mambac's reference models, sharing their tensors.

``convert(model)`` picks the converter registered for the model's class (Hugging Face
``MambaForCausalLM`` / ``MambaModel`` / ``Mamba2ForCausalLM`` / ``Mamba2Model``; mamba_ssm
``MambaLMHeadModel``, ``Mamba``, ``Mamba2``, ``Mamba3``; more with ``register_converter``).
``from_pretrained(path)`` loads a local Hugging Face or mamba_ssm checkpoint directory.
``original_state_dict(model)`` gives a converted model's state dict under the original key names.
See docs/models.md.
"""
from __future__ import annotations

import os
from typing import Any

from mambac.convert import hf, mamba_ssm  # noqa: F401  (register the built-in converters)
from mambac.convert.pretrained import from_pretrained
from mambac.convert.registry import (Conversion, ConversionInfo, conversion_info, convert, find_converter,
                                     is_mambac_model, key_map, load_original_state_dict, original_state_dict,
                                     register_converter, supported_classes, unregister_converter)
from mambac.errors import MambacInputError

__all__ = ["convert", "from_pretrained", "register_converter", "unregister_converter", "supported_classes",
           "original_state_dict", "load_original_state_dict", "key_map", "conversion_info", "Conversion",
           "ConversionInfo", "prepare_model"]


def prepare_model(model: Any) -> Any:
    """What ``mambac.compile`` compiles: a checkpoint path is loaded, a registered foreign model is
    converted, anything else is returned as it is (for compile's own checks)."""
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise MambacInputError(f"mambac.compile takes a torch.nn.Module or the path of a local checkpoint "
                                   f"directory; {str(model)!r} is neither (no such directory).")
        return from_pretrained(model)
    if find_converter(model) is not None:
        return convert(model)
    return model
