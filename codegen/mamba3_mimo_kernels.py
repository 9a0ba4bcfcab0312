"""Generated-kernel implementation of ``mambac::mamba3_mimo``: forward, backward, support test.

Both take the op's positional arguments (``mambac.ops.mamba3_mimo.ARG_NAMES``; the op's
``chunk_size`` only shapes its reference, the kernels' checkpoint interval is ``chunk``) and
launch the kernels of ``render_mamba3_mimo`` for the region the arguments describe.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from mambac.codegen import render_mamba3_mimo as R
from mambac.codegen.autotune import interpreting
from mambac.codegen.mamba3_kernels import supports as _supports
from mambac.codegen.scan_ir import Mamba3MimoRegion, io_of
from mambac.codegen.scan_launch import cdiv, dense, pow2, run_tuned, tiles

DEFAULT_CHUNK = 32
MAX_RANK = 16  # the rank is unrolled in the source; beyond this the reference runs


def supports(*args) -> bool:
    """fp32 / bf16 / fp16 tensors on one device, even dstate, rank <= MAX_RANK."""
    return _supports(*args) and args[1].shape[2] <= MAX_RANK and args[1].shape[-1] % 2 == 0


def region_of(args: Sequence, chunk: int = DEFAULT_CHUNK) -> Mamba3MimoRegion:
    """The region an op call with these arguments describes."""
    (x, B, C, dt, adt, trap, angles, Bb, Cb, ux, uz, uo, D, z, ia, iss, ik, iv, _op_chunk) = args
    return Mamba3MimoRegion(
        io_dtype=io_of(x), chunk=int(chunk), round_bf16=interpreting(), rank=B.shape[2],
        has_B_bias=Bb is not None, has_C_bias=Cb is not None, has_z=z is not None, has_mimo_o=uo is not None,
        has_D=D is not None, init_angle=ia is not None, init_ssm=iss is not None, init_k=ik is not None,
        init_v=iv is not None)


class _Call:
    def __init__(self, args: Sequence, chunk: int):
        x, B, angles = args[0], args[1], args[6]
        self.b, self.l, self.h, self.p = x.shape
        self.r, self.g, self.n, self.s = B.shape[2], B.shape[3], B.shape[4], angles.shape[3]
        self.region = region_of(args, chunk)
        self.nc = cdiv(self.l, chunk)
        self.t = [dense(a) for a in args[:18]]  # every tensor argument, innermost dims dense
        self.x = self.t[0]

    def inputs(self) -> list:
        r, t = self.region, self.t
        return t[:7] + [t[9]] + [a for a, on in ((t[7], r.has_B_bias), (t[8], r.has_C_bias), (t[10], r.has_z),
                                                 (t[11], r.has_mimo_o), (t[12], r.has_D), (t[13], r.has_z)) if on]

    def inits(self) -> list:
        return [a for a in self.t[14:18] if a is not None]

    def sizes(self) -> list[int]:
        return [self.l, self.h, self.g, self.h // self.g, self.p, self.n, self.n // 2, self.s, self.nc]

    @property
    def nh(self) -> int:
        return pow2(self.n // 2)

    def bucket(self) -> tuple:
        return (self.b, self.l, self.h, self.p, self.n, self.r)

    def empty(self, *shape) -> Tensor:
        return torch.empty(*shape, device=self.x.device, dtype=torch.float32)

    def y_shape(self) -> tuple:
        b, l, h, p = self.b, self.l, self.h, self.p
        return (b, l, h, p) if self.region.has_mimo_o else (b, l, self.r, h, p)


def _forward(call: _Call, with_out: bool, checkpoints: bool):
    r, b, h, p, n, s, nc = call.region, call.b, call.h, call.p, call.n, call.s, call.nc
    outs = ([torch.empty(call.y_shape(), device=call.x.device, dtype=call.x.dtype), call.empty(b, h, s),
             call.empty(b, h, p, n), call.empty(b, call.r, h, n), call.empty(b, h, p)] if with_out else [])
    ckpts = ([call.empty(b, h, nc, p, n), call.empty(b, h, nc, call.nh), call.empty(b, h, nc, call.r, n),
              call.empty(b, h, nc, p)] if checkpoints else [])

    def launch(kern, cfg):
        bp = min(cfg.block_m, pow2(p))
        kern.launch((b * h, cdiv(p, bp)), call.inputs() + call.inits() + outs + ckpts + call.sizes(),
                    dict(BP=bp, NH=call.nh, T=r.chunk), cfg.num_warps, cfg.num_stages)

    run_tuned(R.FWD, (r, with_out, checkpoints),
              lambda: R.render_forward(r, with_out=with_out, checkpoints=checkpoints), r.summary(),
              call.bucket(), tiles(max(2, pow2(p) // 2), ((32, 4), (64, 4))), launch)
    return outs, ckpts


def mamba3_mimo_forward(*args, chunk: int = DEFAULT_CHUNK):
    """``mambac::mamba3_mimo`` with generated kernels: (y, final_angle, final_ssm, final_k, final_v)."""
    outs, _ = _forward(_Call(args, chunk), True, False)
    return tuple(outs)


def mamba3_mimo_backward(args: Sequence, grads: Sequence[Optional[Tensor]],
                         needs_input_grad: Sequence[bool] = (), *, chunk: int = DEFAULT_CHUNK) -> tuple:
    """Gradients of every argument (None for absent ones and chunk_size), given the output
    gradients (gy, g_angle, g_ssm, g_k, g_v; None where unused)."""
    call = _Call(args, chunk)
    r, b, l, h, p, n, s, rk = call.region, call.b, call.l, call.h, call.p, call.n, call.s, call.r
    _, ckpts = _forward(call, False, True)
    shapes = [call.y_shape(), (b, h, s), (b, h, p, n), (b, rk, h, n), (b, h, p)]
    gs = [torch.zeros(sh, device=call.x.device, dtype=torch.float32) if g is None else dense(g)
          for g, sh in zip(grads, shapes)]
    gs[1:] = [g.to(torch.float32) for g in gs[1:]]
    nh, outs = call.nh, {}

    def buffers(bp: int) -> list:
        """Outputs for headdim blocks of bp: sums over headdim get a leading block axis."""
        if bp not in outs:
            k, e = cdiv(p, bp), call.empty
            outs[bp] = [e(b, l, h, p), e(k, b, l, rk, h, n), e(k, b, l, rk, h, n), e(k, b, l, h), e(k, b, l, h),
                        e(k, b, l, h), e(k, b, l, h, s), e(k, b, h, s), e(b, h, p, n), e(k, b, rk, h, n), e(b, h, p),
                        e(b, h, rk, p)]
            outs[bp] += [t for t, on in ((e(b, h, rk, p), r.has_z), (e(b, h, rk, p), r.has_mimo_o),
                                         (e(k, b, h), r.has_D), (e(b, l, h, p), r.has_z)) if on]
            outs[bp].append(e(b * h * k * r.chunk * (2 * bp * nh + 2 * rk * nh + bp + nh)))  # scratch
        return outs[bp]

    def launch(kern, cfg):
        bp = min(cfg.block_m, pow2(p))
        *res, scratch = buffers(bp)
        kern.launch((b * h, cdiv(p, bp)), call.inputs() + ckpts + [scratch] + gs + res + call.sizes() + [b],
                    dict(BP=bp, NH=nh, T=r.chunk), cfg.num_warps, cfg.num_stages)
        return bp

    bp = run_tuned(R.BWD, r, lambda: R.render_backward(r), r.summary(), call.bucket(),
                   tiles(max(2, pow2(p) // 2), ((32, 4), (64, 8))), launch)
    res = buffers(bp)[:-1]
    dx, dBh, dCh, ddt, dadt, dtrap, dang, dia, dis, dik, div, dux = res[:12]
    dBh, dCh, ddt, dadt, dtrap, dang, dia, dik = (t.sum(0) for t in (dBh, dCh, ddt, dadt, dtrap, dang, dia, dik))
    dinit = [dia, dis, dik, div]
    rest = iter(res[12:])
    duz = next(rest) if r.has_z else None
    duo = next(rest) if r.has_mimo_o else None
    dD = next(rest).sum(0) if r.has_D else None
    dz = next(rest) if r.has_z else None
    x, B, C, dt, adt, trap, angles, Bb, Cb, ux, uz, uo, D, z, ia, iss, ik, iv, _ = args
    g = call.g
    dB = dBh.unflatten(3, (g, h // g)).sum(4)
    dC = dCh.unflatten(3, (g, h // g)).sum(4)

    def cast(t, like):
        return None if like is None else t.to(like.dtype)

    return (cast(dx, x), cast(dB, B), cast(dC, C), cast(ddt, dt), cast(dadt, adt), cast(dtrap, trap),
            cast(dang, angles), None if Bb is None else cast(dBh.sum((0, 1)).transpose(0, 1), Bb),
            None if Cb is None else cast(dCh.sum((0, 1)).transpose(0, 1), Cb), cast(dux.sum(0), ux),
            None if uz is None else cast(duz.sum(0), uz), None if uo is None else cast(duo.sum(0), uo),
            None if D is None else cast(dD.sum(0), D), None if z is None else cast(dz, z),
            cast(dinit[0], ia), cast(dinit[1], iss), cast(dinit[2], ik), cast(dinit[3], iv), None)
