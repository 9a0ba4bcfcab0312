"""Tensor descriptors for generated kernels that load their tiles through TMA (Hopper and later).

A descriptor names a 2-D view of a tensor (rows x columns, columns contiguous) and the block a
kernel loads from it; on an sm_90+ GPU Triton turns a descriptor load into a TMA copy, so the
kernel spends no instructions on per-element addresses.  The interpreter runs the same loads on
CPU tensors.  Views that TMA cannot address (a base not 16-byte aligned, a row stride not a
multiple of 16 bytes, rows that are not evenly spaced) are copied to a dense tensor first.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from mambac.codegen.autotune import interpreting
from mambac.knobs import knobs


@functools.lru_cache(maxsize=1)
def _descriptor_class() -> Any:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side tensor descriptors
        return None
    return TensorDescriptor


def available() -> bool:
    """Whether descriptor-loading kernels can run here: ``MAMBAC_TMA`` not 0, a Triton with host
    tensor descriptors, and either the interpreter or the current CUDA device at compute
    capability 9.0 or above."""
    if not knobs().tma or _descriptor_class() is None:
        return False
    if interpreting():
        return True
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def launch_descriptors(cfg: Any, even: bool, kernel: str,
                       views: list[tuple[Tensor, int, tuple[int, int]]]) -> list:
    """The descriptor arguments of one launch: none for a pointer-loading config; for a
    descriptor-loading one (``cfg.tma``), ``rows(*view)`` of each (tensor, lead, block) view, after
    checking the launch is EVEN (its forms have no bounds masks)."""
    if not cfg.tma:
        return []
    if not even:
        raise ValueError(f"the descriptor-loading {kernel} needs an EVEN launch (the length a multiple "
                         "of the chunk, tiles dividing it, power-of-two headdim and dstate)")
    return [rows(t, lead, block) for t, lead, block in views]


def _addressable(t: Tensor, row_stride: int) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and (row_stride * size) % 16 == 0


def rows(t: Tensor, lead: int, block: tuple[int, int]) -> Any:
    """A descriptor over ``t`` seen as (product of its first ``lead`` dims) x (the rest), loading
    ``block``-shaped tiles.  The trailing dims must be dense (their product the row length) and the
    leading ones evenly spaced; otherwise, or where TMA cannot address the view, a dense copy of
    ``t`` is described instead."""
    shape = list(t.shape)
    n_rows = 1
    for s in shape[:lead]:
        n_rows *= s
    n_cols = 1
    for s in shape[lead:]:
        n_cols *= s
    if not _dense_view(t, lead) or not _addressable(t, t.stride(lead - 1)):
        t = t.clone(memory_format=torch.contiguous_format)   # a fresh (16-byte aligned) allocation
        if not _addressable(t, n_cols):
            raise ValueError(f"rows of {n_cols} {t.dtype} elements are not a multiple of 16 bytes: "
                             "TMA cannot load them (use the pointer-loading tiles)")
    return _descriptor_class()(t, [n_rows, n_cols], [t.stride(lead - 1), 1], list(block))


def _dense_view(t: Tensor, lead: int) -> bool:
    """Whether ``t`` is laid out as rows of its trailing dims (dense) at one stride apart."""
    expect = 1
    for d in range(t.dim() - 1, lead - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != expect:
            return False
        expect *= t.shape[d]
    row = t.stride(lead - 1)
    if row < expect:
        return False
    for d in range(lead - 2, -1, -1):
        row *= t.shape[d + 1]
        if t.shape[d] != 1 and t.stride(d) != row:
            return False
    return True
