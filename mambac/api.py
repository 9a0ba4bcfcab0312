"""``mambac.compile``: the main door."""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from mambac.errors import MambacInputError, MambacOptionsError
from mambac.lowering import bind_inputs
from mambac.options import CompileOptions
from mambac.runtime.compiled_module import CompiledModule


class _LMInputChecks:
    """``check_token_batch`` on every call (a class, so that a compiled module pickles with its
    checks).  ``local_pieces``: each rank passes its own piece of the sequence
    (cp_inputs='local'), which may be empty; the cp ranks check the lengths together."""

    def __init__(self, vocab_size: int, local_pieces: bool = False) -> None:
        self.vocab_size = vocab_size
        self.local_pieces = local_pieces

    def __call__(self, values: list[Any]) -> None:
        from mambac.models.lm import check_token_batch
        check_token_batch(values[0], values[1] if len(values) > 1 else None, self.vocab_size, self.local_pieces)


def _input_checks(model: torch.nn.Module, opts: CompileOptions):
    """Cheap checks on every call, before any kernel or collective runs."""
    from mambac.models.lm import MambaLMHeadModel, MixerModel

    local = opts.cp > 1 and opts.cp_inputs == "local"
    if isinstance(model, MambaLMHeadModel):
        return _LMInputChecks(model.config.padded_vocab_size, local)
    if isinstance(model, MixerModel):   # a backbone without head (an HF MambaModel / Mamba2Model)
        return _LMInputChecks(model.embedding.num_embeddings, local)
    return None


def _warn_if_triton_cannot_run(model: torch.nn.Module, opts: CompileOptions) -> None:
    """kernels='triton' asks for the generated kernels wherever they can run; a CPU model runs them
    only in Triton's interpreter, so without it the reference ops run: say so once, at compile."""
    from mambac.ops._common import interpreting
    first = next(iter(model.parameters()), None)
    if opts.kernels == "triton" and first is not None and first.device.type == "cpu" and not interpreting():
        warnings.warn("kernels='triton' with the model on the CPU runs the reference ops: the generated kernels "
                      "run on CPU tensors only in Triton's interpreter (set TRITON_INTERPRET=1 before anything "
                      "imports Triton), or move the model to CUDA.", stacklevel=3)


def compile(model: torch.nn.Module, world_size: int = 1, *, example_inputs: Sequence[Any] | None = None,
            **options: Any) -> CompiledModule:
    """Compile ``model`` into a fused module (``world_size`` ranks; see ``CompileOptions``).

    Options are validated before anything else happens.  ``plan="auto"`` chooses the layout (tp,
    dp, cp, sequence_parallel, remat, memory_budget) with the planner for ``device_memory``,
    ``batch`` and ``seqlen`` (see ``mambac.plan_auto``).  With ``example_inputs`` (or a model that
    provides ``example_inputs()``) the program is lowered now, so errors surface here; otherwise on
    the first call (a lone tensor is taken as the forward's one argument); they get the same
    input checks as a call.  The result shares the model's parameters and ``state_dict`` keys.
    """
    from mambac import plan_auto
    auto = plan_auto.wants_auto(options)
    if auto:
        plan_auto.check_request(world_size, options)
    elif any(options.get(k) is not None for k in plan_auto.PLANNED_FOR):
        raise MambacOptionsError("device_memory, batch and seqlen are read by plan='auto' only; pass plan='auto' "
                                 "or drop them.")
    else:
        opts = CompileOptions.create(world_size=world_size, **options)
    if isinstance(example_inputs, torch.Tensor):   # the forward's one argument, given bare
        example_inputs = (example_inputs,)
    from mambac.convert import prepare_model  # a checkpoint path or a foreign (HF, mamba_ssm) model
    given, model = model, prepare_model(model)
    source = given if isinstance(given, torch.nn.Module) and given is not model else None
    if not isinstance(model, torch.nn.Module):
        raise MambacInputError(f"mambac.compile takes a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(model, CompiledModule):
        raise MambacInputError("this module is already compiled by mambac; compile the original model "
                               "(compiled.original_module) instead.")
    if auto:  # the planner's best layout that this version can compile (mambac/plan_auto.py)
        opts = plan_auto.resolve(model, world_size, example_inputs, options)
    _warn_if_triton_cannot_run(model, opts)
    from mambac.backend_foreign import hf_checkpointing
    if source is not None and hf_checkpointing(source) and opts.remat == "none":
        warnings.warn(f"mambac: {type(source).__name__} has gradient checkpointing on; the converted model mambac "
                      "compiles does not carry it over, so nothing would be recomputed. Pass remat='full' (every "
                      "block recomputed in backward) or remat='auto' with a memory_budget.", stacklevel=2)
    checks = _input_checks(model, opts)
    compiled = CompiledModule(model, opts, checks, source)
    if example_inputs is None and hasattr(model, "example_inputs"):
        example_inputs = model.example_inputs()
    if example_inputs is not None:
        if checks is not None:
            checks(bind_inputs(model, example_inputs, {}))
        compiled.program_for(*example_inputs)
    return compiled
