"""Direct launches of generated kernels on CUDA, without Triton's per-call dispatch.

Triton's ``kernel[grid](...)`` binds the arguments, computes their specialisation, hashes it with
the options and looks the compiled kernel up on every call.  A generated kernel is launched many
times per training step with arguments of the same kinds, so after the first launch through
Triton, ``DirectLaunches`` keeps the compiled kernel under a key at least as fine as what Triton
specialises on (dtype and 16-byte alignment of each tensor, each scalar's value, each tensor
descriptor's dtype, sizes, strides and block, the constexprs, the launch options and the device)
and later launches with the same key call its launcher directly.  Any argument of another kind,
a launch hook installed in Triton (profilers), the interpreter or ``MAMBAC_DIRECT_LAUNCH=0``
sends the call through Triton's path instead.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

_TABLE_LIMIT = 256  # keys kept per kernel (one per argument layout and size); beyond it, start over


def spec_key(args: Sequence[Any]) -> Optional[tuple]:
    """A key at least as fine as what Triton specialises on for these positional arguments
    (integers by value, tensors by dtype and 16-byte alignment), or None for a kind of argument this
    module does not follow (the caller then launches through Triton)."""
    key = []
    put = key.append
    for a in args:
        t = type(a)
        if t is int or t is bool or t is float or a is None:
            put((t, a))
        elif t is torch.Tensor or isinstance(a, torch.Tensor):
            put((a.dtype, a.data_ptr() & 15 == 0))
        elif t.__name__ == "TensorDescriptor":  # triton.tools.tensor_descriptor: the launcher encodes it
            base = a.base
            put((base.dtype, base.data_ptr() & 15 == 0, tuple(a.shape), tuple(a.strides),
                 tuple(a.block_shape), getattr(a, "padding", None)))
        else:
            return None
    return tuple(key)


def _active(hook: Any) -> bool:
    """Whether a Triton launch hook does anything (newer Tritons keep an empty chain of hooks)."""
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.lru_cache(maxsize=1)
def _triton_runtime() -> Any:
    """``triton.knobs.runtime``, or None for a Triton without knobs."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


def _hooks_installed() -> bool:
    rt = _triton_runtime()
    if rt is None:  # a Triton without knobs: always take its own path
        return True
    return _active(getattr(rt, "launch_enter_hook", None)) or _active(getattr(rt, "launch_exit_hook", None))


class DirectLaunches:
    """The compiled kernels of one Triton ``JITFunction``, by specialisation key."""

    def __init__(self, fn: Any):
        self.fn = fn
        self.names = list(getattr(fn, "arg_names", ()))
        self.table: dict[tuple, tuple[Any, tuple]] = {}
        self.failed = False  # a direct launch raised: this kernel keeps to Triton's path

    def key(self, args: Sequence[Any], constexprs: dict[str, int],
            options: dict[str, int]) -> Optional[tuple]:
        spec = spec_key(args)
        if spec is None or len(self.names) != len(args) + len(constexprs):
            return None
        return (spec, tuple(constexprs.items()), tuple(options.items()), torch.cuda.current_device())

    def launch(self, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, int],
               options: dict[str, int], slow: Callable[[], Any]) -> None:
        """Launch directly when this key was launched before; otherwise through ``slow`` (Triton's
        path), remembering the compiled kernel it returns."""
        key = self.key(args, constexprs, options) if args and _on_cuda(args) else None
        if key is None or self.failed or _hooks_installed():
            slow()
            return
        hit = self.table.get(key)
        if hit is None:
            compiled = slow()
            tail = tuple(constexprs[n] for n in self.names[len(args):] if n in constexprs)
            if compiled is not None and len(tail) == len(constexprs) and hasattr(compiled, "function"):
                if len(self.table) >= _TABLE_LIMIT:
                    self.table.clear()
                self.table[key] = (compiled, tail)
            return
        compiled, tail = hit
        g = tuple(grid) + (1, 1)
        try:
            stream = torch._C._cuda_getCurrentRawStream(key[3])
            compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None,
                         None, None, *args, *tail)
        except Exception:
            # a Triton whose launcher takes other arguments: Triton's own path from now on (a
            # launch that fails for any other reason fails there again, with its own error)
            self.failed = True
            self.table.clear()
            slow()


def _on_cuda(args: Sequence[Any]) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.is_cuda
    return False
