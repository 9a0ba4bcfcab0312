"""Lowering: capture one forward signature of a model and run the pass pipeline on it.

For more than one rank, rank r's program is lowered from rank r's *local model* (``mambac.sharding_plan``:
parameters cut to its shards, local sizes), with the plan and mesh in ``gm.meta`` for the
sharding passes.  ``lower_all_ranks`` lowers every rank's program without any process group (for
``mambac dump --world-size W`` and for reading the collectives a configuration implies).
Under context parallelism (cp > 1) a rank's program is lowered for *its piece* of the sequence
(``cp_pieces``); the whole length is recorded for ``split_sequence``, and one program is lowered
per whole length (the halo and the pieces' sizes depend on it).
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx

from mambac import capture as capture_mod
from mambac.errors import MambacInputError
from mambac.ir import CP_LENGTH, GLOBAL_SHAPES, MESH, PLAN, VAL, MeshSpec
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


@dataclass
class RankSetup:
    """What one rank's programs are lowered from: its local model, plan and mesh."""

    model: torch.nn.Module
    plan: Any
    mesh: MeshSpec


def rank_setup(model: torch.nn.Module, options: CompileOptions, mesh: MeshSpec) -> RankSetup:
    """Build the local model of the rank ``mesh`` describes (copies of its parameter shards)."""
    from mambac.sharding_plan import local_model, make_plan
    plan = make_plan(model, mesh.tp, mesh.tp_rank, dict(options.plan))
    return RankSetup(model=local_model(model, plan), plan=plan, mesh=mesh)


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


def sequence_length(values: Sequence[Any]) -> int:
    """The sequence length of bound inputs: dim 1 of every tensor input of two or more dims (they
    must agree), as context parallelism splits them."""
    lengths = {int(v.shape[1]) for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2}
    if not lengths:
        raise MambacInputError("context parallelism splits the sequence (dim 1) of the inputs, but no input has "
                               "two or more dims; pass (batch, seqlen, ...) tensors.")
    if len(lengths) > 1:
        raise MambacInputError(f"context parallelism splits dim 1 of every input of two or more dims, but they "
                               f"differ ({sorted(lengths)}); give all sequence inputs the same length.")
    return lengths.pop()


def cp_pieces(values: Sequence[Any], cp_rank: int, cp: int) -> tuple[list[Any], int]:
    """This cp rank's piece of every sequence input (dim 1 of tensors with two or more dims) and the
    whole length.  Pieces are contiguous, in rank order, the first ``L % cp`` ranks one longer."""
    from mambac.runtime.context_parallel import local_piece
    length = sequence_length(values)
    local = [local_piece(v, 1, cp_rank, cp) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v for v in values]
    return local, length


def lower(model: torch.nn.Module, values: Sequence[Any], options: CompileOptions, rank: int = 0,
          setup: RankSetup | None = None, cp_length: int | None = None) -> Lowered:
    """Capture ``model`` (``setup.model`` for a rank of several) for the given (bound) input values
    and run the pipeline for ``rank``.  Under cp, ``values`` are this rank's pieces and
    ``cp_length`` the whole sequence's length."""
    full_model = model
    if setup is not None:
        model = setup.model
    names = list(inspect.signature(model.forward).parameters)
    concrete = {n: None for n, v in zip(names, values) if v is None}
    gm = capture_mod.trace_with(model, concrete)
    capture_mod.propagate_shapes(gm, list(values))
    if setup is not None:
        gm.meta[PLAN], gm.meta[MESH] = setup.plan, setup.mesh
        gm.meta[GLOBAL_SHAPES] = _global_shapes(full_model, concrete, values)
        gm.meta[CP_LENGTH] = cp_length
    ctx = make_context(options, rank)
    checkpoints = gm.meta.get(capture_mod.CHECKPOINT_CALLS) or []
    gm = run_passes(gm, ctx, pipeline_for(options))
    if checkpoints and options.remat == "none":
        _keep_the_models_checkpoints(gm, checkpoints, ctx)
    return Lowered(gm=gm, ctx=ctx, signature=signature_of(values))


def _keep_the_models_checkpoints(gm: torch.fx.GraphModule, checkpoints: list, ctx) -> None:
    """The model's own ``torch.utils.checkpoint`` calls (traced through by capture) as recompute
    regions, where each checkpoints a submodule whose nodes stay one run (``plan_remat.
    checkpoint_modules``); otherwise a warning that nothing is recomputed and which options do."""
    from mambac.passes.plan_remat import checkpoint_modules
    why = checkpoint_modules(gm, checkpoints, ctx) if None not in checkpoints else (
        "a checkpointed function is not a submodule of the model")
    if why:
        warnings.warn(
            f"mambac: the model calls torch.utils.checkpoint ({len(checkpoints)} call(s) in one forward), but "
            f"{why}, so mambac.compile traces through them: they recompute nothing and their activations are "
            "kept. Pass remat='full' (every block recomputed in backward) or remat='auto' with a memory_budget "
            "for mambac's own recompute.", stacklevel=4)


def _global_shapes(model: torch.nn.Module, concrete: dict, values: Sequence[Any]) -> dict[str, tuple]:
    """Node name -> shape in the unsharded model's graph (the local graph has the same node names):
    tells the sharding rules which dim of a view holds the split (size-1 dims are ambiguous locally)."""
    gm = capture_mod.trace_with(model, concrete)
    capture_mod.propagate_shapes(gm, list(values))
    return {n.name: tuple(n.meta[VAL].shape) for n in gm.graph.nodes if isinstance(n.meta.get(VAL), torch.Tensor)}


def lower_all_ranks(model: torch.nn.Module, example_inputs: Sequence[Any], world_size: int,
                    **options: Any) -> list[Lowered]:
    """Every rank's lowered program for ``example_inputs``, without process groups (dumps)."""
    from mambac.runtime.mesh import offline_spec
    opts = CompileOptions.create(world_size=world_size, **options)
    values = bind_inputs(model, tuple(example_inputs), {})
    out = []
    for rank in range(world_size):
        setup = rank_setup(model, opts, offline_spec(opts, rank)) if world_size > 1 else None
        mine, length = (cp_pieces(values, setup.mesh.cp_rank, opts.cp) if opts.cp > 1 else (values, None))
        out.append(lower(model, mine, opts, rank, setup, length))
    return out
