"""What the layout planner (``mambac.autoplan``) knows about a model, unsharded: saved-activation
bytes as ``a + b*B + c*L + d*B*L`` (split into the part tensor parallelism shards and the part it
replicates), FLOPs and bytes moved per token, parameter counts, and the state and halo a cp rank
passes on; and ``measure``, which reads all of it off the memory model (``mambac.memory``) of the
model's single-device program lowered once at a small example shape.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import sympy
import torch

from mambac.errors import MambacInputError
from mambac.memory import B as SYM_B, L as SYM_L


@dataclass(frozen=True)
class ActBytes:
    """Saved-for-backward bytes ``a + b*B + c*L + d*B*L`` at batch B and sequence length L, split
    into the part tensor parallelism shards (mixer internals, vocabulary-parallel logits) and the
    part it replicates (the residual stream: sharded only under sequence parallelism)."""

    sharded: tuple[float, float, float, float]
    replicated: tuple[float, float, float, float]

    @staticmethod
    def _eval(c: tuple[float, float, float, float], b: float, l: float) -> float:
        return c[0] + c[1] * b + c[2] * l + c[3] * b * l

    def per_rank(self, b: float, l: float, tp: int, sp: bool) -> float:
        """Bytes one rank keeps for a local batch ``b`` of local length ``l``."""
        return self._eval(self.sharded, b, l) / tp + self._eval(self.replicated, b, l) / (tp if sp else 1)


@dataclass(frozen=True)
class ModelCost:
    """What the planner needs to know about a model, unsharded.  ``from_module`` measures it with
    the memory model; tests and back-of-envelope studies may write one by hand."""

    params: int                     # parameter count
    param_bytes: int                # bytes per parameter (and per gradient element)
    optimizer_bytes: int            # optimizer state bytes per parameter (AdamW fp32: 8)
    n_layer: int
    d_model: int
    act: dict[str, ActBytes]        # remat mode -> saved activations
    flops_per_token: float          # forward FLOPs per token
    io_bytes_per_token: float       # forward bytes moved per token
    recompute_flops_per_token: dict[str, float]
    state_bytes: float              # per sequence per layer: the recurrent state a cp rank passes on
    halo_bytes: float               # per sequence per layer: the conv inputs a cp rank passes on
    max_tp: int                     # tp beyond this leaves a rank without a head
    act_elem_bytes: int = 2         # element size of the activations tp/sp communicate
    recompute_io_bytes_per_token: dict[str, float] | None = None   # default: io in proportion to FLOPs

    @classmethod
    def from_module(cls, model: torch.nn.Module, example: tuple[int, int] = (2, 32),
                    optimizer_bytes: int = 8) -> ModelCost:
        return measure(model, example, optimizer_bytes)



def _coefficients(formula, nbytes: int, tokens: int) -> tuple[float, float, float, float]:
    """(a, b, c, d) of ``a + b*B + c*L + d*B*L``; without a formula, all of ``nbytes`` per token."""
    if formula is None:
        return (0.0, 0.0, 0.0, nbytes / tokens)
    poly = sympy.Poly(sympy.expand(formula), SYM_B, SYM_L)
    return tuple(float(poly.coeff_monomial(m)) for m in (1, SYM_B, SYM_L, SYM_B * SYM_L))


def _act_bytes(mem, storages, d_model: int, tokens: int) -> ActBytes:
    """Split ``storages`` into replicated (at most d_model fp32 elements per token: the residual
    stream and what norms save) and tp-sharded, and sum their formulas."""
    parts = {True: [0.0] * 4, False: [0.0] * 4}
    for s in storages:
        coef = _coefficients(mem.formula(s.key), s.nbytes, tokens)
        per_token = coef[3] if coef[3] else s.nbytes / tokens
        acc = parts[per_token <= 4 * d_model]
        for i, c in enumerate(coef):
            acc[i] += c
    return ActBytes(sharded=tuple(parts[False]), replicated=tuple(parts[True]))


def _mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "d_inner") and hasattr(m, "in_proj")]


def _state_and_halo(model: torch.nn.Module) -> tuple[float, float, int]:
    """Per sequence per layer: fp32 recurrent state bytes and bf16 conv halo bytes; and the head
    count (the largest useful tp)."""
    mixers = _mixers(model)
    if not mixers:
        return 0.0, 0.0, 1 << 30
    m = mixers[0]
    d_state = getattr(m, "d_state", None) or getattr(getattr(m, "A_log", None), "shape", (0, 16))[-1]
    conv = getattr(m, "conv1d", None)
    halo = (conv.kernel_size[0] - 1) * conv.in_channels * 2 if conv is not None else 0
    heads = getattr(m, "nheads", None) or m.d_inner
    return float(m.d_inner * d_state * 4), float(halo), int(heads)


def _d_model(model: torch.nn.Module) -> int:
    d = getattr(getattr(model, "config", None), "d_model", None)
    if d is None:
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        if emb is None:
            raise MambacInputError(f"cannot tell the model width of {type(model).__name__}: give it a "
                                   "config.d_model or an nn.Embedding, or pass a ModelCost.")
        d = emb.embedding_dim
    return int(d)


def _training_inputs(model: torch.nn.Module, example: tuple[int, int]) -> tuple:
    """The model's example inputs, plus labels (the ids) when its forward takes ``labels`` and
    they are missing: a training step computes the loss inside the model."""
    from mambac.cli import _example_inputs
    inputs = tuple(_example_inputs(model, *example))
    names = list(inspect.signature(model.forward).parameters)
    if "labels" in names and len(inputs) == names.index("labels"):
        inputs += (inputs[0].clone(),)
    return inputs


def measure(model: torch.nn.Module, example: tuple[int, int] = (2, 32), optimizer_bytes: int = 8) -> ModelCost:
    """A ``ModelCost`` from the memory model of ``model``'s single-device program lowered at
    ``example`` = (B, L): saved bytes (as formulas in B and L) without remat and with every block
    recomputed, FLOPs and bytes moved per token, plus parameter counts and the state sizes."""
    from mambac.convert import prepare_model
    from mambac.lowering import bind_inputs, lower
    from mambac.memory import analyse
    from mambac.options import CompileOptions
    from mambac.passes.plan_remat import choose_full

    model = prepare_model(model)
    values = bind_inputs(model, _training_inputs(model, example), {})
    gm = lower(model, values, CompileOptions.create()).gm
    mem, tokens, d_model = analyse(gm), example[0] * example[1], _d_model(model)
    full = choose_full(gm)
    recomputed = [n for r in full for n in r.nodes]
    state, halo, heads = _state_and_halo(model)
    params = list(model.parameters())
    n_layer = getattr(getattr(model, "config", None), "n_layer", None) or max(len(_mixers(model)), 1)
    return ModelCost(
        params=sum(p.numel() for p in params), param_bytes=params[0].element_size() if params else 4,
        optimizer_bytes=optimizer_bytes, n_layer=int(n_layer), d_model=d_model,
        act={"none": _act_bytes(mem, mem.kept(), d_model, tokens),
             "full": _act_bytes(mem, mem.kept(full), d_model, tokens)},
        flops_per_token=mem.flops(mem.order) / tokens,
        io_bytes_per_token=sum(c.io_bytes for c in mem.run.costs.values()) / tokens,
        recompute_flops_per_token={"none": 0.0, "full": mem.flops(recomputed) / tokens},
        recompute_io_bytes_per_token={"none": 0.0, "full": sum(mem.run.costs[n].io_bytes for n in recomputed
                                                               if n in mem.run.costs) / tokens},
        state_bytes=state, halo_bytes=halo, max_tp=heads)
