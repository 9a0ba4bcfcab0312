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


def _find(slot: _Slot, source: Mapping[str, torch.Tensor], candidates: Candidates) -> tuple[str, str] | None:
    """(mambac key, original key) of the first name of ``slot`` present in ``source``."""
    for key in slot.keys:
        for orig in candidates(key):
            if orig in source:
                return key, orig
    return None


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
          what: str, ignore: Callable[[str], bool] = lambda key: False) -> dict[str, str]:
    """Fill every parameter and buffer of the meta-built ``model`` from ``source`` (original keys).

    ``candidates(k)`` lists the original names of mambac key ``k``; ``ignore(orig)`` marks source keys
    that may be left over (e.g. a redundant copy of a tied weight).  ``what`` names the source in
    errors.  Returns the key map (every mambac key → its original key).
    """
    used: set[str] = set()
    key_map: dict[str, str] = {}
    for slot in _slots(model):
        found = _find(slot, source, candidates)
        if found is None:
            names = " or ".join(f"'{c}'" for c in candidates(slot.keys[0]))
            raise MambacInputError(f"{what} has no tensor {names} (needed for mambac's '{slot.keys[0]}'); "
                                   "the checkpoint does not match its configuration.")
        _, orig = found
        value = source[orig]
        if tuple(value.shape) != tuple(slot.meta.shape):
            raise MambacInputError(f"{what}: tensor '{orig}' has shape {tuple(value.shape)}, but the "
                                   f"configuration needs {tuple(slot.meta.shape)}.")
        value = _as_parameter(value, slot.meta) if slot.is_param else value
        for key in slot.keys:
            _install(model, key, value, slot.is_param)
            alias = next((c for c in candidates(key) if c in source), candidates(key)[0])
            key_map[key] = alias
            used.add(alias)
    extra = sorted(k for k in source if k not in used and not ignore(k))
    if extra:
        raise MambacInputError(f"{what} has tensors the configuration does not use: {extra[:8]}"
                               f"{' ...' if len(extra) > 8 else ''}; the checkpoint does not match its configuration.")
    return key_map


def check_shapes(value: torch.Tensor, key: str, shape: tuple, what: str) -> None:
    """A clear error when a tied duplicate disagrees in shape with the tensor it duplicates."""
    if tuple(value.shape) != tuple(shape):
        raise MambacInputError(f"{what}: tensor '{key}' has shape {tuple(value.shape)}, expected {tuple(shape)}.")
