"""Lowering: capture one forward signature of a model and run the pass pipeline on it."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx

from mambac import capture as capture_mod
from mambac.errors import MambacInputError
from mambac.knobs import knobs
from mambac.options import CompileOptions
from mambac.passes.context import PassContext
from mambac.passes.pipeline import pipeline_for
from mambac.passes.runner import run_passes


@dataclass
class Lowered:
    """One rank's lowered program for one forward signature, with what the passes reported."""

    gm: torch.fx.GraphModule
    ctx: PassContext
    signature: tuple[bool, ...]


def bind_inputs(model: torch.nn.Module, args: Sequence[Any], kwargs: dict) -> list[Any]:
    """All forward parameters in order, defaults filled in (so one positional call runs the graph)."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as exc:
        raise MambacInputError(f"{type(model).__name__}.forward{sig}: {exc}") from exc
    bound.apply_defaults()
    return list(bound.arguments.values())


def signature_of(values: Sequence[Any]) -> tuple[bool, ...]:
    """Which forward parameters are given (not None): one graph is lowered per signature."""
    return tuple(v is not None for v in values)


def make_context(options: CompileOptions, rank: int = 0) -> PassContext:
    k = knobs()
    return PassContext(
        options=options, rank=rank, world_size=options.world_size,
        verify=k.verify if options.verify is None else options.verify,
        dump_dir=options.dump_dir or k.dump_dir,
        disabled=tuple(options.disable_passes) or k.disable_passes,
    )


def lower(model: torch.nn.Module, values: Sequence[Any], options: CompileOptions, rank: int = 0) -> Lowered:
    """Capture ``model`` for the given (bound) input values and run the pipeline for ``rank``."""
    names = list(inspect.signature(model.forward).parameters)
    concrete = {n: None for n, v in zip(names, values) if v is None}
    gm = capture_mod.trace_with(model, concrete)
    capture_mod.propagate_shapes(gm, list(values))
    ctx = make_context(options, rank)
    gm = run_passes(gm, ctx, pipeline_for(options))
    return Lowered(gm=gm, ctx=ctx, signature=signature_of(values))
