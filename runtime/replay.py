"""A lean recompute for ``plan_remat``'s regions: one ``torch.autograd.Function`` per region call.

Its forward runs the region's body without autograd and keeps only the body's inputs; its backward
runs the body again with autograd, under the forward's kernel mode and autocast state, and takes
``torch.autograd.grad`` of the recomputed outputs with respect to the inputs and the body's
trainable parameters (passed to the Function as inputs of its own, so their gradients flow back
through autograd's usual accumulators: ``.grad``, DDP's hooks and ``torch.autograd.grad`` of the
caller all see them as without remat).

Why not ``torch.utils.checkpoint``: its non-reentrant form packs every tensor the body saves through
saved-tensor hooks and checks each replayed tensor's metadata, which costs the host several times
the body's own dispatch on small ops (``benchmarks/remat_host_overhead.py``); its reentrant form
accumulates parameter gradients inside its backward, out of reach of ``torch.autograd.grad``.
What this one leaves to ``torch.utils.checkpoint`` (``plan_remat`` picks it there): a body that
draws random numbers (its generators' states are not saved here) and a traced call (AOTAutograd,
which records the replay in its backward graph).  It does not support double backward.
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten


class _Call:
    """What a region call's backward needs besides its saved tensors."""

    __slots__ = ("body", "template", "n_args", "mode", "autocast", "names", "out_template", "out_spec")

    def __init__(self, body: torch.nn.Module, template: list, n_args: int, mode: str, autocast: tuple,
                 names: Sequence[str]) -> None:
        self.body, self.template, self.n_args, self.mode, self.autocast = body, template, n_args, mode, autocast
        self.names = names             # the body's attribute path of each trainable parameter passed in
        self.out_template: list = []   # the output's leaves, tensors as _TENSOR (set by the forward)
        self.out_spec = None

    def outputs(self, out: Any) -> list[torch.Tensor]:
        """The tensors among the leaves of the body's output (any nesting of tuples and lists)."""
        leaves, self.out_spec = tree_flatten(out)
        self.out_template = [_TENSOR if isinstance(v, torch.Tensor) else v for v in leaves]
        return [v for v in leaves if isinstance(v, torch.Tensor)]

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        return tree_unflatten(_fill(self.out_template, tensors), self.out_spec)


def _autocast_state(device_types: Sequence[str]) -> tuple:
    """(device type, dtype) of each device type where autocast is on now."""
    from mambac.ops._common import autocast_dtype
    return tuple((d, dtype) for d in device_types if (dtype := autocast_dtype(d)) is not None)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        ctx.params = tensors[call.n_args:]   # the body's own attributes: held, not saved
        ctx.save_for_backward(*tensors[:call.n_args])
        from mambac.ops import use_kernels
        with use_kernels(call.mode):
            outs = call.outputs(call.body(*_fill(call.template, tensors[:call.n_args])))
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        call: _Call = ctx.call
        need = ctx.needs_input_grad[1:]
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(ctx.saved_tensors, need)]
        args = _fill(call.template, leaves)
        run = call.body
        if all(_attribute(call.body, name) is t for name, t in zip(call.names, ctx.params)):
            leaves += ctx.params
        else:
            # the forward ran with other tensors in the parameters' places (``torch.func.functional_call``,
            # as the torch.compile backend's several-rank program swaps its shards in): replay with those
            swapped = {name: t.detach().requires_grad_() for name, t in zip(call.names, ctx.params)}
            leaves += swapped.values()

            def run(*a: Any) -> Any:
                return torch.func.functional_call(call.body, swapped, a, strict=False)
        from mambac.ops import use_kernels
        with torch.enable_grad(), use_kernels(call.mode), _autocast(call.autocast):
            outs = [v for v in tree_flatten(run(*args))[0] if isinstance(v, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, n in enumerate(need) if n]
        result: list[torch.Tensor | None] = [None] * len(leaves)
        if pairs and wanted:
            got = torch.autograd.grad([o for o, _ in pairs], [leaves[i] for i in wanted], [g for _, g in pairs],
                                      allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = g
        return (None, *result)


def _autocast(state: tuple) -> contextlib.ExitStack:
    """Re-enter the forward's autocast state (per device type) around the replay."""
    stack = contextlib.ExitStack()
    for device_type, dtype in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype))
    return stack


def _attribute(module: torch.nn.Module, path: str) -> Any:
    """What ``module`` holds at the dotted ``path`` now (a parameter, or a tensor swapped in)."""
    owner, _, name = path.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name, None)


def _fill(template: list, tensors: Sequence[torch.Tensor]) -> list:
    """The call's arguments: ``template`` with its tensor slots (``_TENSOR``) filled in order."""
    it = iter(tensors)
    return [next(it) if slot is _TENSOR else slot for slot in template]


_TENSOR = object()


def replay(body: torch.nn.Module, args: Sequence[Any], mode: str, params: dict[str, torch.Tensor]) -> Any:
    """Run ``body(*args)`` keeping only its tensor arguments for backward, which recomputes it
    (kernel ``mode``, this call's autocast state).  ``params``: the body's parameters by attribute
    path, as they are now (``body.named_parameters()``); those that require grad get gradients,
    and the replay runs with these very tensors even if others have taken their places since."""
    template = [_TENSOR if isinstance(a, torch.Tensor) else a for a in args]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not torch.is_grad_enabled():
        from mambac.ops import use_kernels
        with use_kernels(mode):
            return body(*args)
    seen = {id(t) for t in tensors}
    trainable = {name: p for name, p in params.items() if p.requires_grad and id(p) not in seen}
    devices = {"cpu"} | {t.device.type for t in tensors[:1]}
    call = _Call(body, template, len(tensors), mode, _autocast_state(sorted(devices)), tuple(trainable))
    return call.rebuild(_Replay.apply(call, *tensors, *trainable.values()))
