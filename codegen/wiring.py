"""Registers the generated kernels as the device kernels of mambac's ops.

Imported by ``mambac.ops`` the first time a call could use generated kernels (see
``mambac.ops._common``): CUDA tensors in kernel mode 'auto' or 'triton', CPU tensors in mode
'triton' under ``TRITON_INTERPRET=1``.  Each op gets a forward (the op's schema arguments in, the
reference's outputs out), a backward (``(args, grads, needs_input_grad)`` -> one gradient per
argument) and a ``supports`` predicate; inputs the kernels do not take run the reference.
"""
from __future__ import annotations

import torch

from mambac.codegen.kernel_ir import KERNEL_DTYPES
from mambac.ops._common import register_device_kernels


def tensors_supported(*args) -> bool:
    """Floating tensors all fp32/bf16/fp16 and on one device, the first one non-empty (float64 and
    empty inputs take the reference)."""
    dev = None
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None or first.numel() == 0:  # nothing to launch over: the reference handles it
        return False
    for a in args:
        if not isinstance(a, torch.Tensor):
            continue
        if a.is_floating_point() and a.dtype not in KERNEL_DTYPES:
            return False
        if dev is None:
            dev = a.device
        elif a.device != dev:
            return False
    return dev is not None


# ---- ssd ------------------------------------------------------------------------------------------

def _ssd_forward(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus, dt_min, dt_max):
    from mambac.codegen.ssd_kernels import ssd_forward
    y, final = ssd_forward(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus,
                           dt_min, dt_max)
    return y.contiguous(), final.contiguous()


def _ssd_backward(args: list, grads: tuple, needs: tuple) -> tuple:
    from mambac.codegen.ssd_kernels_bwd import ssd_backward
    x = args[0]
    dy, dfinal = grads
    if dy is None:
        dy = torch.zeros_like(x)
    got = ssd_backward(dy, None if dfinal is None else dfinal.float(), *args)
    return tuple(got) + (None,) * 4


def _ssd_supports(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, *_):
    return x.dtype in KERNEL_DTYPES and tensors_supported(x, dt, A, B, C, D, z, dt_bias, initial_state)


def register() -> None:
    """Register every op's generated kernels for CUDA (and so for the interpreter)."""
    register_device_kernels("ssd", "cuda", forward=_ssd_forward, backward=_ssd_backward,
                            supports=_ssd_supports)
    from mambac.codegen import conv_kernels, norm_kernels
    conv_kernels.register()
    norm_kernels.register()


register()
