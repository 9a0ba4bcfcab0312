"""The converter registry: foreign model classes → functions that rebuild them as mambac models.

Converters are keyed by the *qualified class name* (``module.QualName``) so that registering one for
``transformers`` or ``mamba_ssm`` classes does not import those packages; a model is matched by the
exact class of the object (a subclass may change ``forward``, so it is never matched silently:
register it explicitly, reusing the same function if its math is unchanged).

A converter takes the foreign module and returns a ``Conversion`` (the mambac model plus the map
from its ``state_dict`` keys to the original ones) or just the mambac model when the key names
are unchanged.  ``convert`` records the key map on the result so ``original_state_dict`` can give
the state dict back under the original names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

import torch
import torch.nn as nn

from mambac.errors import MambacConfigError, MambacInputError

INFO_ATTR = "_mambac_conversion"


@dataclass(frozen=True)
class Conversion:
    """What a converter returns: the mambac ``model`` and ``key_map`` (mambac key → original key;
    keys absent from the map keep their name).  ``source`` names where the model came from."""

    model: nn.Module
    key_map: Mapping[str, str] = field(default_factory=dict)
    source: str = ""


Converter = Callable[[nn.Module], Union[Conversion, nn.Module]]
_CONVERTERS: dict[str, Converter] = {}


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, the registry key."""
    return f"{cls.__module__}.{cls.__qualname__}"


def register_converter(cls: type | str, fn: Converter, *, replace: bool = False) -> None:
    """Register ``fn`` as the converter of ``cls`` (a class or its qualified name, e.g.
    ``"transformers.models.mamba.modeling_mamba.MambaForCausalLM"``).  Registering a class twice is
    an error unless ``replace=True``."""
    name = cls if isinstance(cls, str) else qualified_name(cls)
    if not isinstance(name, str) or "." not in name:
        raise MambacInputError(f"register_converter needs a class or a qualified class name such as "
                               f"'package.module.ClassName', got {cls!r}.")
    if not callable(fn):
        raise MambacInputError(f"register_converter: the converter for {name} must be callable, got {fn!r}.")
    if name in _CONVERTERS and not replace:
        raise MambacInputError(f"a converter for {name} is already registered; pass replace=True to override it.")
    _CONVERTERS[name] = fn


def unregister_converter(cls: type | str) -> None:
    """Remove the converter of ``cls`` (no error when there is none)."""
    _CONVERTERS.pop(cls if isinstance(cls, str) else qualified_name(cls), None)


def supported_classes() -> list[str]:
    """Qualified names of every class with a registered converter, sorted."""
    return sorted(_CONVERTERS)


def find_converter(model: object) -> Converter | None:
    """The converter registered for ``type(model)`` (exact class), or None."""
    return _CONVERTERS.get(qualified_name(type(model)))


def is_mambac_model(model: object) -> bool:
    """True for mambac's own reference models (``mambac.models``), which need no conversion."""
    return type(model).__module__.startswith("mambac.models.")


def _unknown(model: nn.Module) -> MambacInputError:
    listed = "\n  ".join(supported_classes())
    return MambacInputError(
        f"mambac has no converter for {qualified_name(type(model))}. Supported classes:\n  {listed}\n"
        "mambac's own reference models (mambac.models) need none. To add one, write a function that builds "
        "the equivalent mambac model sharing the module's parameters and register it: "
        f"mambac.convert.register_converter('{qualified_name(type(model))}', fn) (see docs/models.md).")


def convert(model: nn.Module) -> nn.Module:
    """The mambac reference model equivalent to ``model``, holding the same parameter tensors.

    mambac models come back unchanged.  Anything else goes to the converter registered for its
    class; an unregistered class is a ``MambacInputError`` listing the supported classes.
    """
    if not isinstance(model, nn.Module):
        raise MambacInputError(f"mambac.convert takes a torch.nn.Module, got {type(model).__name__}.")
    if is_mambac_model(model):
        return model
    fn = find_converter(model)
    if fn is None:
        raise _unknown(model)
    result = fn(model)
    conv = result if isinstance(result, Conversion) else Conversion(result)
    if not isinstance(conv.model, nn.Module):
        raise MambacConfigError(f"the converter for {qualified_name(type(model))} returned "
                                f"{type(conv.model).__name__}, not a torch.nn.Module.")
    _check_round_trip(model, conv)
    attach(conv.model, dict(conv.key_map), conv.source or qualified_name(type(model)))
    return conv.model


def _check_round_trip(original: nn.Module, conv: Conversion) -> None:
    """Every converted key must map onto a key of the original state dict, with the same shape."""
    want = original.state_dict()
    for key, value in conv.model.state_dict().items():
        orig = conv.key_map.get(key, key)
        if orig not in want:
            raise MambacConfigError(f"converted key '{key}' maps to '{orig}', which the original "
                                    f"{type(original).__name__} does not have; fix the converter's key map.")
        if tuple(want[orig].shape) != tuple(value.shape):
            raise MambacConfigError(f"converted key '{key}' has shape {tuple(value.shape)} but the original "
                                    f"'{orig}' has {tuple(want[orig].shape)}; fix the converter.")


@dataclass(frozen=True)
class ConversionInfo:
    """Recorded on a converted (or loaded) model: where it came from and its key map."""

    source: str
    key_map: dict[str, str]


def attach(model: nn.Module, key_map: dict[str, str], source: str) -> None:
    """Record ``key_map`` and ``source`` on ``model`` (outside its parameters and state dict)."""
    model.__dict__[INFO_ATTR] = ConversionInfo(source=source, key_map=key_map)


def _underlying(model: nn.Module) -> nn.Module:
    from mambac.runtime.compiled_module import CompiledModule

    return model.original_module if isinstance(model, CompiledModule) else model


def conversion_info(model: nn.Module) -> ConversionInfo | None:
    """The ``ConversionInfo`` of a converted, loaded or compiled model (None for a native one)."""
    return _underlying(model).__dict__.get(INFO_ATTR)


def key_map(model: nn.Module) -> dict[str, str]:
    """mambac ``state_dict`` key → original key, for every key of ``model`` (identity when native)."""
    info = conversion_info(model)
    mapping = info.key_map if info else {}
    return {k: mapping.get(k, k) for k in _underlying(model).state_dict()}


def original_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under the original model's key names (the same tensors, no copies):
    save it with ``torch.save`` / ``safetensors`` to write a checkpoint in the original format."""
    names = key_map(model)
    return {names[k]: v for k, v in _underlying(model).state_dict().items()}


def load_original_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a state dict written under the original key names into a converted model."""
    inverse = {orig: k for k, orig in key_map(model).items()}
    renamed = {inverse.get(k, k): v for k, v in state_dict.items()}
    return _underlying(model).load_state_dict(renamed, strict=strict)
