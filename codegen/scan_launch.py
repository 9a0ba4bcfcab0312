"""Launch machinery shared by the scan kernels (selective scan, Mamba-3): load a generated kernel
for a region, let autotune pick a tile config per shape bucket and device, launch it.

The scan sources do not depend on the tile config (block sizes are constexpr arguments), so one
generated kernel per (name, region) serves every candidate.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from mambac.codegen import autotune
from mambac.codegen.compile import CompiledKernel, load_kernel
from mambac.codegen.kernel_ir import KERNEL_DTYPES, TileConfig

_SOURCES: dict[tuple, str] = {}
_PLANS: dict[tuple, tuple[CompiledKernel, TileConfig]] = {}


def kernel_for(name: str, key: Any, render: Callable[[], str], describe: str) -> CompiledKernel:
    """Render (once per process and key), store and import the kernel ``name``."""
    k = (name, key)
    if k not in _SOURCES:
        _SOURCES[k] = render()
    src = _SOURCES[k]
    return load_kernel(name, lambda: src, describe)


def run_tuned(name: str, key: Any, render: Callable[[], str], describe: str, sizes: Sequence[int],
              candidates: Sequence[TileConfig], launch: Callable[[CompiledKernel, TileConfig], Any],
              reset: Callable[[], None] | None = None) -> Any:
    """Pick a config for this kernel, region and shape bucket (remembered), then launch.

    ``reset`` runs before every timed launch (kernels that accumulate into their outputs).
    """
    plan = _PLANS.get((name, key, tuple(sizes)))
    if plan is not None:
        return launch(*plan)
    kernel = kernel_for(name, key, render, describe)
    family = autotune.family_key(name, [kernel.source], candidates)

    def bench(cfg: TileConfig) -> float:
        def once() -> None:
            if reset is not None:
                reset()
            launch(kernel, cfg)
        return autotune.time_ms(once)

    cfg = autotune.choose(family, autotune.bucket_key(*sizes), candidates, bench)
    _PLANS[(name, key, tuple(sizes))] = (kernel, cfg)
    if reset is not None:
        reset()
    return launch(kernel, cfg)


def plan_of(name: str, key: Any, sizes: Sequence[int]) -> tuple[CompiledKernel, TileConfig]:
    """The (kernel, config) that ``run_tuned`` chose for these arguments (after it ran once)."""
    return _PLANS[(name, key, tuple(sizes))]


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def tiles(interp_block: int, gpu: Sequence[tuple[int, int]]) -> list[TileConfig]:
    """Candidates: one small tile under the interpreter, else (block, warps) pairs."""
    if autotune.interpreting():
        return [TileConfig(block_m=interp_block, num_warps=1)]
    return [TileConfig(block_m=bm, num_warps=nw) for bm, nw in gpu]


def scan_supports(*args) -> bool:
    """Whether the scan kernels take a call: its tensors floating point, not float64, on the first
    argument's device, and the first argument of an io dtype (anything else runs the reference)."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    if not tensors or args[0].dtype not in KERNEL_DTYPES:
        return False
    dev = args[0].device
    return all(t.device == dev and t.dtype != torch.float64 and t.is_floating_point() for t in tensors)


def cast(t: Tensor | None, like: Tensor | None) -> Tensor | None:
    """Gradient ``t`` in the dtype of the argument ``like`` it belongs to (None where that is absent)."""
    return None if like is None else t.to(like.dtype)
