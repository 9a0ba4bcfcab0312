"""Generated-kernel implementation of ``mambac::mamba3_mimo``: forward, backward, support test.

Both take the op's positional arguments (``mambac.ops.mamba3_mimo.ARG_NAMES``; the op's
``chunk_size`` only shapes its reference, the kernels' checkpoint interval is ``chunk``) and
launch the kernels of ``render_mamba3_mimo`` for the region the arguments describe.
"""
from __future__ import annotations

from typing import Optional, Sequence

from torch import Tensor

from mambac.codegen import render_mamba3_mimo as R
from mambac.codegen.autotune import interpreting
from mambac.codegen.mamba3_launch import Mamba3Call, backward, forward
from mambac.codegen.scan_ir import Mamba3MimoRegion, io_of
from mambac.codegen.kernel_ir import pow2
from mambac.codegen.scan_launch import cast, scan_supports

DEFAULT_CHUNK = 32
MAX_RANK = 16  # the rank is unrolled in the source; beyond this the reference runs


def supports(*args) -> bool:
    """fp32 / bf16 / fp16 tensors on one device, even dstate, rank <= MAX_RANK."""
    return scan_supports(*args) and args[1].shape[2] <= MAX_RANK and args[1].shape[-1] % 2 == 0


def region_of(args: Sequence, chunk: int = DEFAULT_CHUNK) -> Mamba3MimoRegion:
    """The region an op call with these arguments describes."""
    (x, B, C, dt, adt, trap, angles, Bb, Cb, ux, uz, uo, D, z, ia, iss, ik, iv, _op_chunk) = args
    return Mamba3MimoRegion(
        io_dtype=io_of(x), chunk=int(chunk), round_bf16=interpreting(), rank=B.shape[2],
        has_B_bias=Bb is not None, has_C_bias=Cb is not None, has_z=z is not None, has_mimo_o=uo is not None,
        has_D=D is not None, init_angle=ia is not None, init_ssm=iss is not None, init_k=ik is not None,
        init_v=iv is not None)


class _Call(Mamba3Call):
    N_TENSORS = 18

    def __init__(self, args: Sequence, chunk: int):
        super().__init__(args, region_of(args, chunk), chunk)
        self.r = args[1].shape[2]

    def inputs(self) -> list:
        r, t = self.region, self.t
        return t[:7] + [t[9]] + [a for a, on in ((t[7], r.has_B_bias), (t[8], r.has_C_bias), (t[10], r.has_z),
                                                 (t[11], r.has_mimo_o), (t[12], r.has_D), (t[13], r.has_z)) if on]

    def sizes(self) -> list[int]:
        return [self.l, self.h, self.g, self.h // self.g, self.p, self.n, self.n // 2, self.s, self.nc]

    @property
    def nh(self) -> int:
        return pow2(self.n // 2)

    def bucket(self) -> tuple:
        return (self.b, self.l, self.h, self.p, self.n, self.r)

    def scratch_per_step(self, bp: int) -> int:
        return 2 * bp * self.nh + 2 * self.r * self.nh + bp + self.nh

    def keys(self) -> tuple:
        return (self.r,)

    def y_shape(self) -> tuple:
        b, l, h, p = self.b, self.l, self.h, self.p
        return (b, l, h, p) if self.region.has_mimo_o else (b, l, self.r, h, p)


def mamba3_mimo_forward(*args, chunk: int = DEFAULT_CHUNK):
    """``mambac::mamba3_mimo`` with generated kernels: (y, final_angle, final_ssm, final_k, final_v)."""
    return tuple(forward(R, _Call(args, chunk), True, False)[0])


def mamba3_mimo_backward(args: Sequence, grads: Sequence[Optional[Tensor]],
                         needs_input_grad: Sequence[bool] = (), *, chunk: int = DEFAULT_CHUNK) -> tuple:
    """Gradients of every argument (None for absent ones and chunk_size), given the output
    gradients (gy, g_angle, g_ssm, g_k, g_v; None where unused)."""
    call = _Call(args, chunk)
    r, e, b, l, h, p, rk = call.region, call.empty, call.b, call.l, call.h, call.p, call.r

    def extra(k: int) -> list:
        """dux, then duz, duo, per-block dD, dz where the region has them."""
        return [e(b, h, rk, p)] + [t for t, on in ((e(b, h, rk, p), r.has_z), (e(b, h, rk, p), r.has_mimo_o),
                                                   (e(k, b, h), r.has_D), (e(b, l, h, p), r.has_z)) if on]

    got = backward(R, call, args, grads, extra)
    rest = iter(got.extra)
    dux = next(rest)
    duz = next(rest) if r.has_z else None
    duo = next(rest) if r.has_mimo_o else None
    dD = next(rest).sum(0) if r.has_D else None
    dz = next(rest) if r.has_z else None
    Bb, Cb, ux, uz, uo, D, z = args[7:14]
    return (*got.leading, None if Bb is None else cast(got.dBh.sum((0, 1)).transpose(0, 1), Bb),
            None if Cb is None else cast(got.dCh.sum((0, 1)).transpose(0, 1), Cb), cast(dux.sum(0), ux),
            None if uz is None else cast(duz.sum(0), uz), None if uo is None else cast(duo.sum(0), uo),
            None if D is None else cast(dD.sum(0), D), None if z is None else cast(dz, z), *got.inits, None)
