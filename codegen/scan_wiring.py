"""Registers the generated scan kernels (selective scan, Mamba-3 SISO and MIMO) as the ops' device
kernels.

Imported by ``mambac.ops._common`` the first time a call could use kernels (every
``mambac.codegen.*_wiring`` module is); registering imports no Triton.  The Mamba-3 kernels walk
the sequence in order and are not faster than the reference for training yet (forward + backward,
benchmarks/NOTES_scan_kernels.md), so they run only in kernel mode 'triton', never by default.
"""
from __future__ import annotations

from mambac.ops._common import register_device_kernels


def _ss_forward(*args):
    from mambac.codegen.selective_scan_kernels import selective_scan_forward
    return selective_scan_forward(*args)


def _ss_backward(args, grads, needs):
    from mambac.codegen.selective_scan_kernels import selective_scan_backward
    return selective_scan_backward(args, grads, needs)


def _ss_supports(*args) -> bool:
    from mambac.codegen.selective_scan_kernels import supports
    return supports(*args)


def _m3_forward(*args):
    from mambac.codegen.mamba3_kernels import mamba3_siso_forward
    return mamba3_siso_forward(*args)


def _m3_backward(args, grads, needs):
    from mambac.codegen.mamba3_kernels import mamba3_siso_backward
    return mamba3_siso_backward(args, grads, needs)


def _explicit() -> bool:
    from mambac.ops._common import kernel_mode
    return kernel_mode() == "triton"


def _m3_supports(*args) -> bool:
    from mambac.codegen.mamba3_kernels import supports
    return _explicit() and supports(*args)


def _mimo_forward(*args):
    from mambac.codegen.mamba3_mimo_kernels import mamba3_mimo_forward
    return mamba3_mimo_forward(*args)


def _mimo_backward(args, grads, needs):
    from mambac.codegen.mamba3_mimo_kernels import mamba3_mimo_backward
    return mamba3_mimo_backward(args, grads, needs)


def _mimo_supports(*args) -> bool:
    from mambac.codegen.mamba3_mimo_kernels import supports
    return _explicit() and supports(*args)


register_device_kernels("selective_scan", "cuda", forward=_ss_forward, backward=_ss_backward,
                        supports=_ss_supports)
register_device_kernels("mamba3_siso", "cuda", forward=_m3_forward, backward=_m3_backward,
                        supports=_m3_supports)
register_device_kernels("mamba3_mimo", "cuda", forward=_mimo_forward, backward=_mimo_backward,
                        supports=_mimo_supports)
