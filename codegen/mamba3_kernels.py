"""Generated-kernel implementation of ``mambac::mamba3_siso``: forward, backward, support test.

Both take the op's positional arguments (``mambac.ops.mamba3_siso.ARG_NAMES``; the op's own
``chunk_size`` only shapes its reference, the kernels' checkpoint interval is ``chunk``) and
launch the kernels of ``render_mamba3`` for the region the arguments describe.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from mambac.codegen import render_mamba3 as R
from mambac.codegen.autotune import interpreting
from mambac.codegen.mamba3_launch import Mamba3Call, backward, forward
from mambac.codegen.scan_ir import Mamba3SisoRegion, io_of
from mambac.codegen.kernel_ir import cdiv, pow2
from mambac.codegen.scan_launch import cast, scan_supports

DEFAULT_CHUNK = 32  # steps between checkpoints; the backward's scratch holds one chunk of states


supports = scan_supports  # fp32 / bf16 / fp16 tensors on one device (float64 runs the reference)


def region_of(args: Sequence, chunk: int = DEFAULT_CHUNK) -> Mamba3SisoRegion:
    """The region an op call with these arguments describes."""
    (x, B, C, dt, adt, trap, angles, Bb, Cb, D, z, ia, iss, ik, iv, _op_chunk) = args
    return Mamba3SisoRegion(
        io_dtype=io_of(x), chunk=int(chunk), round_bf16=interpreting(), has_B_bias=Bb is not None,
        has_C_bias=Cb is not None, has_D=D is not None, has_z=z is not None, init_angle=ia is not None,
        init_ssm=iss is not None, init_k=ik is not None, init_v=iv is not None)


class _Call(Mamba3Call):
    N_TENSORS = 15

    def __init__(self, args: Sequence, chunk: int):
        super().__init__(args, region_of(args, chunk), chunk)

    def inputs(self) -> list:
        r, t = self.region, self.t
        return t[:7] + [a for a, on in ((t[7], r.has_B_bias), (t[8], r.has_C_bias), (t[9], r.has_D),
                                        (t[10], r.has_z)) if on]

    def sizes(self) -> list[int]:
        return [self.l, self.h, self.g, self.h // self.g, self.p, self.n, self.s, self.nc]

    @property
    def nh(self) -> int:
        return pow2(cdiv(self.n, 2))

    def bucket(self) -> tuple:
        return (self.b, self.l, self.h, self.p, self.n)

    def scratch_per_step(self, bp: int) -> int:
        return 2 * bp * self.nh + 4 * self.nh + bp


def mamba3_siso_forward(*args, chunk: int = DEFAULT_CHUNK):
    """``mambac::mamba3_siso`` with generated kernels: (y, final_angle, final_ssm, final_k, final_v)."""
    return tuple(forward(R, _Call(args, chunk), True, False)[0])


def mamba3_siso_backward(args: Sequence, grads: Sequence[Optional[Tensor]],
                         needs_input_grad: Sequence[bool] = (), *, chunk: int = DEFAULT_CHUNK) -> tuple:
    """Gradients of every argument (None for absent ones and chunk_size), given the output
    gradients (gy, g_angle, g_ssm, g_k, g_v; None where unused)."""
    call = _Call(args, chunk)
    r, e, b, l, h, p = call.region, call.empty, call.b, call.l, call.h, call.p
    got = backward(R, call, args, grads,
                   lambda k: [t for t, on in ((e(k, b, h), r.has_D), (e(b, l, h, p), r.has_z)) if on])
    dD = got.extra[0].sum(0) if r.has_D else None
    dz = got.extra[-1] if r.has_z else None
    Bb, Cb, D, z = args[7:11]
    return (*got.leading, None if Bb is None else cast(got.dBh.sum((0, 1)), Bb),
            None if Cb is None else cast(got.dCh.sum((0, 1)), Cb), None if D is None else cast(dD.sum(0), D),
            None if z is None else cast(dz, z), *got.inits, None)
