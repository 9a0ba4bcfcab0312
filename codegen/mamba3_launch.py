"""Launch code shared by the Mamba-3 SISO and MIMO kernels (``mamba3_kernels``,
``mamba3_mimo_kernels``): the forward (outputs and/or chunk checkpoints) and the backward with its
per-headdim-block gradient buffers.

A ``Mamba3Call`` subclass says where the variant's arguments sit and which extra key axes its
states have (MIMO: one key per rank); the kernels it launches come from the variant's renderer
module (``FWD``, ``BWD``, ``render_forward``, ``render_backward``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from mambac.codegen.scan_ir import Mamba3Region
from mambac.codegen.kernel_ir import cdiv, pow2
from mambac.codegen.scan_launch import cast, dense, run_tuned, tiles


class Mamba3Call(ABC):
    """An op call's arguments laid out as the kernels read them, plus sizes."""

    N_TENSORS: int  # the op's arguments before chunk_size

    def __init__(self, args: Sequence, region: Mamba3Region, chunk: int):
        x, B, angles = args[0], args[1], args[6]
        self.region = region
        self.b, self.l, self.h, self.p = x.shape
        self.g, self.n, self.s = B.shape[-2], B.shape[-1], angles.shape[3]
        self.nc = cdiv(self.l, chunk)
        self.t = [dense(a) for a in args[:self.N_TENSORS]]  # every tensor argument, innermost dims dense
        self.x = self.t[0]

    @abstractmethod
    def inputs(self) -> list:
        """Input tensors the region has, in launch order."""

    @abstractmethod
    def sizes(self) -> list[int]:
        """The kernels' runtime size arguments."""

    @property
    @abstractmethod
    def nh(self) -> int:
        """Lanes of a state half (a power of two)."""

    @abstractmethod
    def bucket(self) -> tuple:
        """The sizes autotune keys its choice on."""

    @abstractmethod
    def scratch_per_step(self, bp: int) -> int:
        """Floats of backward scratch per step for a headdim block of ``bp``."""

    def inits(self) -> list:
        """The incoming state parts given (the op's last four tensor arguments)."""
        return [a for a in self.t[self.N_TENSORS - 4:] if a is not None]

    def keys(self) -> tuple:
        """The key axes of states before (heads, dstate): () for one key, (rank,) for MIMO."""
        return ()

    def y_shape(self) -> tuple:
        return (self.b, self.l, self.h, self.p)

    def empty(self, *shape) -> Tensor:
        return torch.empty(*shape, device=self.x.device, dtype=torch.float32)


def forward(R: ModuleType, call: Mamba3Call, with_out: bool, checkpoints: bool):
    """Run the forward kernel: (outputs y, final angle/ssm/k/v if ``with_out``; chunk checkpoints
    of state/angle/k/x if ``checkpoints``)."""
    r, b, h, p, n, s, nc, keys = call.region, call.b, call.h, call.p, call.n, call.s, call.nc, call.keys()
    outs = ([torch.empty(call.y_shape(), device=call.x.device, dtype=call.x.dtype), call.empty(b, h, s),
             call.empty(b, h, p, n), call.empty(b, *keys, h, n), call.empty(b, h, p)] if with_out else [])
    ckpts = ([call.empty(b, h, nc, p, n), call.empty(b, h, nc, call.nh), call.empty(b, h, nc, *keys, n),
              call.empty(b, h, nc, p)] if checkpoints else [])

    def launch(kern, cfg):
        bp = min(cfg.block_m, pow2(p))
        kern.launch((b * h, cdiv(p, bp)), call.inputs() + call.inits() + outs + ckpts + call.sizes(),
                    dict(BP=bp, NH=call.nh, T=r.chunk), cfg)

    run_tuned(R.FWD, (r, with_out, checkpoints),
              lambda: R.render_forward(r, with_out=with_out, checkpoints=checkpoints), r.summary(),
              call.bucket(), tiles(max(2, pow2(p) // 2), ((32, 4), (64, 4))), launch)
    return outs, ckpts


class Mamba3Grads(NamedTuple):
    """What the backward gives: the gradients of x, B, C, dt, adt, trap, angles and of the four
    incoming state parts (in their arguments' dtypes, None for absent ones), the per-head gradients
    of B and C (for the biases, fp32), and the variant's extra buffers."""
    leading: list
    inits: list
    dBh: Tensor
    dCh: Tensor
    extra: list


def backward(R: ModuleType, call: Mamba3Call, args: Sequence, grads: Sequence[Optional[Tensor]],
             extra: Callable[[int], list[Tensor]]) -> Mamba3Grads:
    """Run the backward kernel given the op's arguments and its output gradients (gy, g_angle,
    g_ssm, g_k, g_v; None where unused).  ``extra(k)``: the variant's further gradient buffers for
    k headdim blocks (before the scratch)."""
    r, b, l, h, p, n, s, keys = call.region, call.b, call.l, call.h, call.p, call.n, call.s, call.keys()
    _, ckpts = forward(R, call, False, True)
    shapes = [call.y_shape(), (b, h, s), (b, h, p, n), (b, *keys, h, n), (b, h, p)]
    gs = [torch.zeros(sh, device=call.x.device, dtype=torch.float32) if g is None else dense(g)
          for g, sh in zip(grads, shapes)]
    gs[1:] = [g.to(torch.float32) for g in gs[1:]]
    outs: dict[int, list] = {}

    def buffers(bp: int) -> list:
        """Outputs for headdim blocks of bp: sums over headdim get a leading block axis."""
        if bp not in outs:
            k, e = cdiv(p, bp), call.empty
            outs[bp] = [e(b, l, h, p), e(k, b, l, *keys, h, n), e(k, b, l, *keys, h, n), e(k, b, l, h), e(k, b, l, h),
                        e(k, b, l, h), e(k, b, l, h, s), e(k, b, h, s), e(b, h, p, n), e(k, b, *keys, h, n), e(b, h, p)]
            outs[bp] += extra(k)
            outs[bp].append(e(b * h * k * r.chunk * call.scratch_per_step(bp)))
        return outs[bp]

    def launch(kern, cfg):
        bp = min(cfg.block_m, pow2(p))
        *res, scratch = buffers(bp)
        kern.launch((b * h, cdiv(p, bp)), call.inputs() + ckpts + [scratch] + gs + res + call.sizes() + [b],
                    dict(BP=bp, NH=call.nh, T=r.chunk), cfg)
        return bp

    bp = run_tuned(R.BWD, r, lambda: R.render_backward(r), r.summary(), call.bucket(),
                   tiles(max(2, pow2(p) // 2), ((32, 4), (64, 8))), launch)
    res = buffers(bp)[:-1]
    dx, dBh, dCh, ddt, dadt, dtrap, dang, dia, dis, dik, div = res[:11]
    dBh, dCh, ddt, dadt, dtrap, dang, dia, dik = (t.sum(0) for t in (dBh, dCh, ddt, dadt, dtrap, dang, dia, dik))
    lead = (dx, per_group(call, dBh), per_group(call, dCh), ddt, dadt, dtrap, dang)
    inits = (dia, dis, dik, div)
    return Mamba3Grads([cast(g, a) for g, a in zip(lead, args[:7])],
                       [cast(g, a) for g, a in zip(inits, args[call.N_TENSORS - 4:call.N_TENSORS])], dBh, dCh, res[11:])


def per_group(call: Mamba3Call, dh: Tensor) -> Tensor:
    """A per-head gradient of B or C (heads on dim -2) summed over the heads of each group."""
    return dh.unflatten(-2, (call.g, call.h // call.g)).sum(-2)
