"""Recompute costs of graph nodes for the memory model: FLOPs (``2*M*N*K`` for matmuls, the SSM
ops from their shapes, ~1 per element otherwise) and bytes moved per node run, and the ``Machine``
roofline that turns them into seconds.  Part of ``mambac.memory`` (docs/memory.md)."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
import torch.nn.functional as F

from mambac.ops._common import info_for_target
from mambac.ops.linear_cross_entropy import linear_cross_entropy

MATMUL_FUNCTIONS = (F.linear, torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.einsum, torch.addmm)
MATMUL_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)


@dataclass(frozen=True)
class Machine:
    """Roofline used to turn FLOPs and bytes into seconds (defaults: one H200, dense bf16)."""

    flops_per_s: float = 989e12
    bytes_per_s: float = 4.8e12

    def seconds(self, flops: int, nbytes: int) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


@dataclass(frozen=True)
class NodeCost:
    """Forward cost of one node at the example shape: FLOPs and bytes read plus written."""

    flops: int
    io_bytes: int


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def op_name(n: torch.fx.Node) -> str:
    """A short printable name of what a node does."""
    if n.op == "call_module":
        return f"self.{str(n.target).rsplit('.', 1)[-1]}"
    if n.op == "call_method":
        return f".{n.target}"
    info = info_for_target(n.target) if n.op == "call_function" else None
    if info is not None:
        return f"mambac.{info.name}"
    return getattr(n.target, "__name__", str(n.target))


def is_matmul(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    """Whether ``n`` is a matrix product (recomputing it is what remat avoids first)."""
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), MATMUL_MODULES)
    if n.op == "call_method":
        return n.target in ("matmul", "bmm", "mm")
    return n.op == "call_function" and any(n.target is f for f in MATMUL_FUNCTIONS)


def _first(args: Sequence[Any]) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _scan_flops(x: torch.Tensor, bmat: torch.Tensor, groups: int, chunk: int, rank: int = 1) -> int:
    """Chunked scans over x (b, l, h, p): intra-chunk (C.B) and (weights @ x) products, chunk
    states in and out, the elementwise epilogue; ``rank`` multiplies it (Mamba-3's trapezoid, MIMO)."""
    b, l, h, p = x.shape
    n, t = bmat.shape[-1], min(chunk, l)
    return rank * (2 * b * l * t * (groups * n + h * p) + 4 * b * l * h * p * n + 10 * b * l * h * p)


OP_FLOPS: dict[str, Callable[[Sequence[Any]], int]] = {   # an op's OpInfo.extra["remat_flops"] wins
    "ssd": lambda a: _scan_flops(a[0], a[3], a[3].shape[-2], a[9]),
    "selective_scan": lambda a: 20 * a[0].numel() * a[2].shape[1],   # exp, drive, ~6 scan passes, C.h
    "causal_conv1d": lambda a: 2 * a[0].numel() * a[1].shape[-1],
    "gated_rmsnorm": lambda a: 6 * a[0].numel(),
    "add_rmsnorm": lambda a: 6 * a[0].numel(),
    "mamba3_siso": lambda a: _scan_flops(a[0], a[1], a[0].shape[2], a[-1], rank=2),
    "mamba3_mimo": lambda a: _scan_flops(a[0], a[1], a[0].shape[2], a[-1], rank=2 * a[1].shape[2]),
}


def _flops(gm: torch.fx.GraphModule, n: torch.fx.Node, args, out: Any) -> int:
    outs = _tensors(out)
    numel = sum(t.numel() for t in outs)
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, torch.nn.Linear):
            return 2 * numel * mod.in_features
        return 0 if isinstance(mod, torch.nn.Embedding) else numel
    if is_matmul(gm, n):
        a = _first(args)
        return 2 * numel * (a.shape[-1] if a is not None and a.dim() else 1)
    info = info_for_target(n.target) if n.op == "call_function" else None
    if info is not None:
        rule = info.extra.get("remat_flops") or OP_FLOPS.get(info.name)
        return int(rule(args)) if rule is not None else 10 * numel
    if n.op == "call_function" and n.target is F.cross_entropy:
        return 5 * _first(args).numel()
    if n.op == "call_function" and n.target is linear_cross_entropy:   # (N, D) @ (D, V), then the loss
        (tokens, d), vocab = args[0].shape, args[1].shape[0]
        return 2 * tokens * d * vocab + 5 * tokens * vocab
    return numel


def node_cost(gm: torch.fx.GraphModule, n: torch.fx.Node, args, kwargs, out: Any, new_bytes: int) -> NodeCost:
    """FLOPs and bytes of one node run; a node that allocates nothing (a view) is free."""
    if n.op == "get_attr" or (new_bytes == 0 and n.op != "call_module" and info_for_target(n.target) is None):
        return NodeCost(0, 0)
    in_bytes = sum(t.numel() * t.element_size() for t in _tensors(list(args) + list(kwargs.values())))
    return NodeCost(_flops(gm, n, args, out), in_bytes + new_bytes)
