"""Shared machinery for mambac's custom ops.

Every op module in ``mambac/ops`` defines a plain-PyTorch *reference* function (differentiable,
written with ordinary torch ops, exact in float64) and registers a ``torch.library`` custom op whose
eager implementation calls that reference.  The autograd rule registered here recomputes the
reference under ``torch.enable_grad`` and takes its vector-Jacobian product: it is exact, needs no
hand-written backward, and stays correct whatever options the op was called with.  Faster backward
kernels (Triton, see ``mambac.codegen``) replace the per-device implementation, never the semantics.

Invariant: an op's reference is the single source of truth; fake (meta) functions only describe
shapes and dtypes and must agree with the reference on every output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mambac.errors import MambacInputError


@dataclass(frozen=True)
class OpInfo:
    """What the rest of mambac needs to know about one op.

    ``op`` is the custom-op overload packet (``torch.ops.mambac.<name>``), ``reference`` the plain
    PyTorch function with the same positional signature, ``arg_names`` the schema's argument names
    in order (passes use them to read and rewrite arguments by name), ``n_outputs`` how many tensors
    the op returns.
    """

    name: str
    op: Any
    reference: Callable[..., Any]
    arg_names: tuple[str, ...]
    n_outputs: int
    doc: str = ""
    extra: dict = field(default_factory=dict)


_REGISTRY: dict[str, OpInfo] = {}


def register_info(info: OpInfo) -> OpInfo:
    _REGISTRY[info.name] = info
    return info


def op_info(name: str) -> OpInfo:
    return _REGISTRY[name]


def all_op_infos() -> dict[str, OpInfo]:
    return dict(_REGISTRY)


def info_for_target(target: Any) -> OpInfo | None:
    """The OpInfo whose custom op is ``target`` (an OpOverloadPacket or OpOverload), else None."""
    packet = getattr(target, "overloadpacket", target)
    for info in _REGISTRY.values():
        if info.op is packet:
            return info
    return None


def state_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Recurrent state is at least fp32: float64 inputs (the referee) keep float64."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype that a reference computes in: fp32 for half types, the input dtype otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def register_recompute_autograd(op: Any, reference: Callable[..., Any], n_outputs: int) -> None:
    """Give ``op`` an autograd rule that differentiates ``reference`` by recomputation.

    Tensor inputs are saved (not the outputs); non-tensor inputs ride on ``ctx``.  Gradients of
    outputs that the caller did not use arrive as ``None`` and are skipped.
    """

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.tensor_pos = tensor_pos
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.save_for_backward(*[inputs[i] for i in tensor_pos])

    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        saved = ctx.saved_tensors
        args = list(ctx.others)
        wants = []
        for pos, t in zip(ctx.tensor_pos, saved):
            need = ctx.needs_input_grad[pos] and t.is_floating_point()
            leaf = t.detach().requires_grad_(need)
            args[pos] = leaf
            if need:
                wants.append((pos, leaf))
        result = [None] * len(args)
        if not wants:
            return tuple(result)
        with torch.enable_grad():
            outs = reference(*args)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if not pairs:
            return tuple(result)
        got = torch.autograd.grad(
            [o for o, _ in pairs], [leaf for _, leaf in wants], [g for _, g in pairs], allow_unused=True
        )
        for (pos, leaf), g in zip(wants, got):
            result[pos] = torch.zeros_like(leaf) if g is None else g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


def check(cond: bool, op: str, message: str) -> None:
    """Raise a MambacInputError naming the op when ``cond`` is false."""
    if not cond:
        raise MambacInputError(f"mambac.ops.{op}: {message}")


def check_float(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise MambacInputError(
                f"mambac.ops.{op}: {name} must be a floating-point tensor, got {t.dtype}; "
                f"cast it with {name}.float() (or .bfloat16())."
            )


def check_shape(op: str, name: str, t: torch.Tensor | None, shape: Sequence[int | None]) -> None:
    """Check ``t``'s shape against ``shape`` (None entries match anything)."""
    if t is None:
        return
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise MambacInputError(f"mambac.ops.{op}: {name} has shape {tuple(t.shape)}, expected {want}.")
