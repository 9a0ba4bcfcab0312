"""Put existing tensors into a freshly built mambac model, without copying them.

Converters build the mambac model on the ``meta`` device (no memory, no initialisation cost), then
``adopt`` places the source tensors in it: a source ``nn.Parameter`` is installed as it is, so the
converted model and the original share every parameter (an optimiser step on one is seen by the
other); a plain tensor (from a checkpoint file) becomes a new ``nn.Parameter`` around the same
storage.  Tied parameters (one tensor under several names) are found by identity on the meta model
and filled from whichever of their names the source provides.  Anything missing, left over or of
the wrong shape is a ``MambacInputError`` that names the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn

from mambac.errors import MambacConfigError, MambacInputError

# mambac key → the original keys it may be stored under, most usual first
Candidates = Callable[[str], Sequence[str]]


@dataclass
class _Slot:
    """One parameter (or buffer) of the target and every dotted name it has."""

    keys: list[str]
    meta: torch.Tensor
    is_param: bool


def build_on_meta(factory: Callable[..., nn.Module], *args, **kwargs) -> nn.Module:
    """Construct a mambac module on the meta device; constructor errors become ``MambacConfigError``."""
    try:
        return factory(*args, device="meta", **kwargs)
    except TypeError as exc:
        raise MambacConfigError(f"cannot build {getattr(factory, '__name__', factory)} from the converted "
                                f"configuration: {exc}") from exc


def _slots(model: nn.Module) -> list[_Slot]:
    by_id: dict[int, _Slot] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), _Slot([], p, True)).keys.append(key)
    for key, b in model.named_buffers(remove_duplicate=False):
        by_id.setdefault(id(b), _Slot([], b, False)).keys.append(key)
    return list(by_id.values())


def _find(slot: _Slot, source: Mapping[str, torch.Tensor], candidates: Candidates) -> str | None:
    """The original key under which ``source`` holds the tensor of ``slot`` (any of its names)."""
    return next((orig for key in slot.keys for orig in candidates(key) if orig in source), None)


def _as_parameter(value: torch.Tensor, meta: torch.Tensor) -> nn.Parameter:
    if isinstance(value, nn.Parameter):
        return value  # shared with the original model
    param = nn.Parameter(value, requires_grad=meta.requires_grad and value.is_floating_point())
    for attr in ("_no_weight_decay",):
        if hasattr(meta, attr):
            setattr(param, attr, getattr(meta, attr))
    return param


def _install(model: nn.Module, key: str, value: torch.Tensor, is_param: bool) -> None:
    owner, _, name = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    if is_param:
        module._parameters[name] = value
    else:
        module._buffers[name] = value


def adopt(model: nn.Module, source: Mapping[str, torch.Tensor], candidates: Candidates, *,
          what: str, live: bool = False) -> dict[str, str]:
    """Fill every parameter and buffer of the meta-built ``model`` from ``source`` (original keys).

    ``candidates(k)`` lists the original names of mambac key ``k``; ``what`` names the source in
    errors.  With ``live`` (a live model's parameters) every name of a tied slot must hold the very
    same tensor; a checkpoint may store copies, which must have the right shape and are otherwise
    not used.  Returns the key map (every mambac key → its original key).
    """
    key_map: dict[str, str] = {}
    for slot in _slots(model):
        key_map.update(_fill(model, slot, source, candidates, what, live))
    extra = sorted(set(source) - set(key_map.values()))
    if extra:
        raise MambacInputError(f"{what} has tensors the configuration does not use: {extra[:8]}"
                               f"{' ...' if len(extra) > 8 else ''}; the weights do not match the configuration.")
    return key_map


def _fill(model: nn.Module, slot: _Slot, source: Mapping[str, torch.Tensor], candidates: Candidates,
          what: str, live: bool) -> dict[str, str]:
    """Install the tensor of one slot under all its names; returns their original keys."""
    orig = _find(slot, source, candidates)
    if orig is None:
        names = " or ".join(f"'{c}'" for c in candidates(slot.keys[0]))
        raise MambacInputError(f"{what} has no tensor {names} (needed for mambac's '{slot.keys[0]}'); "
                               "the weights do not match the configuration.")
    value = source[orig]
    if tuple(value.shape) != tuple(slot.meta.shape):
        raise MambacInputError(f"{what}: tensor '{orig}' has shape {tuple(value.shape)}, but the "
                               f"configuration needs {tuple(slot.meta.shape)}.")
    value = _as_parameter(value, slot.meta) if slot.is_param else value
    names = {}
    for key in slot.keys:
        _install(model, key, value, slot.is_param)
        alias = next((c for c in candidates(key) if c in source), candidates(key)[0])
        if alias in source and alias != orig:
            _check_duplicate(source[alias], source[orig], alias, orig, what, live)
        names[key] = alias
    return names


def _check_duplicate(dup: torch.Tensor, first: torch.Tensor, dup_key: str, key: str, what: str, live: bool) -> None:
    """A second name of a tied tensor must be that tensor (live) or a copy of its shape (checkpoint)."""
    if live and dup is not first:
        raise MambacConfigError(f"{what}: '{dup_key}' and '{key}' are separate tensors, but the converted "
                                "configuration ties them; the converter's tie detection is wrong.")
    if tuple(dup.shape) != tuple(first.shape):
        raise MambacInputError(f"{what}: tensor '{dup_key}' has shape {tuple(dup.shape)}, but it is tied to "
                               f"'{key}' of shape {tuple(first.shape)}.")
