"""Generated-kernel implementation of ``mambac::selective_scan``: forward, backward, wiring.

``selective_scan_forward`` and ``selective_scan_backward`` take the op's positional arguments
(``mambac.ops.selective_scan.ARG_NAMES``) and launch the kernels of ``render_selective_scan``
for the region the arguments describe.  ``supports`` says which calls they take (fp32 / bf16 /
fp16 tensors on one device); anything else runs the op's reference.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from mambac.codegen import render_selective_scan as R
from mambac.codegen.autotune import interpreting
from mambac.codegen.scan_ir import SelectiveScanRegion, io_of
from mambac.codegen.kernel_ir import cdiv, pow2
from mambac.codegen.scan_launch import cast, dense, plan_of, run_tuned, scan_supports, tiles

DEFAULT_CHUNK = 64  # steps per chunk (the unit of parallelism along the sequence)
SCRATCH_BYTES = 1 << 30  # the backward's recomputed states: chunks run in waves that fit this


def region_of(u: Tensor, D, z, delta_bias, initial_state, delta_softplus: bool,
              chunk: int = DEFAULT_CHUNK) -> SelectiveScanRegion:
    return SelectiveScanRegion(io_dtype=io_of(u), chunk=int(chunk), round_bf16=interpreting(),
                               has_delta_bias=delta_bias is not None, delta_softplus=bool(delta_softplus),
                               has_D=D is not None, has_z=z is not None, has_init=initial_state is not None)


supports = scan_supports  # whether the generated kernels take this call (else the reference runs)


class _Call:
    """The op's arguments laid out as the kernels read them, plus sizes."""

    def __init__(self, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, chunk):
        self.region = region_of(u, D, z, delta_bias, initial_state, delta_softplus, chunk)
        self.b, self.d, self.l = u.shape
        self.grouped = B.dim() == 4
        self.B = dense(B if self.grouped else B.unsqueeze(1))
        self.C = dense(C if C.dim() == 4 else C.unsqueeze(1))
        self.n, self.g = A.shape[1], self.B.shape[1]
        self.dpg, self.nc = self.d // self.g, cdiv(self.l, chunk)
        self.u, self.delta, self.A, self.z = dense(u), dense(delta), dense(A), dense(z)
        self.D, self.bias, self.init = dense(D), dense(delta_bias), dense(initial_state)

    def inputs(self) -> list:
        r = self.region
        return [self.u, self.delta, self.A, self.B, self.C] + [
            t for t, on in ((self.D, r.has_D), (self.z, r.has_z), (self.bias, r.has_delta_bias)) if on]

    def sizes(self, bd: int) -> list[int]:
        return [self.l, self.d, self.n, self.g, self.dpg, cdiv(self.dpg, bd), self.nc]

    def candidates(self):
        return tiles(min(16, pow2(self.dpg)), ((8, 1), (16, 2), (32, 4)))

    def bucket(self) -> tuple:
        return (self.b, self.d, self.n, self.g, self.l)

    def grid(self, bd: int, chunks: bool = True) -> tuple[int, ...]:
        base = (self.g * cdiv(self.dpg, bd), self.b)
        return base + (self.nc,) if chunks else base

    def consts(self, bd: int) -> dict:
        return dict(BD=bd, NP=pow2(self.n), T=self.region.chunk)

    def f32(self, *shape) -> Tensor:
        return torch.empty(*shape, device=self.u.device, dtype=torch.float32)

    def run(self, name: str, render, args: list, chunks: bool = True) -> int:
        """Launch kernel ``name`` (autotuned block of channels) with ``args`` + sizes; returns BD."""
        r = self.region

        def launch(kern, cfg):
            kern.launch(self.grid(cfg.block_m, chunks), args + self.sizes(cfg.block_m), self.consts(cfg.block_m),
                        cfg)
            return cfg.block_m

        return run_tuned(name, r, lambda: render(r), r.summary(), self.bucket(), self.candidates(), launch)


def _states(call: _Call) -> tuple[Tensor, Tensor, Tensor]:
    """Chunk-local pass and combine: (checkpoints, last state, per-chunk sums of delta')."""
    b, d, n, nc = call.b, call.d, call.n, call.nc
    local, sdl, ckpt, last = call.f32(b, nc, d, n), call.f32(b, nc, d), call.f32(b, nc, d, n), call.f32(b, d, n)
    call.run(R.LOCAL, R.render_chunk_local, call.inputs() + [local, sdl])
    init = [call.init] if call.region.has_init else []
    call.run(R.COMBINE, R.render_combine, [call.A] + init + [local, sdl, ckpt, last], chunks=False)
    return ckpt, last, sdl


def selective_scan_forward(u, delta, A, B, C, D=None, z=None, delta_bias=None, initial_state=None,
                           delta_softplus=False, *, chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """``mambac::selective_scan`` with generated kernels: (out, last_state)."""
    call = _Call(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, chunk)
    ckpt, last, _ = _states(call)
    out = torch.empty(call.b, call.d, call.l, device=u.device, dtype=u.dtype)
    call.run(R.OUT, R.render_chunk_out, call.inputs() + [ckpt, out])
    return out, last


def selective_scan_backward(args: Sequence, grads: Sequence[Optional[Tensor]],
                            needs_input_grad: Sequence[bool] = (), *, chunk: int = DEFAULT_CHUNK) -> tuple:
    """Gradients of every tensor argument (None for absent ones and the flag), given the output
    gradients (gout, glast; None where unused)."""
    u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus = args
    call = _Call(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, chunk)
    r, f32 = call.region, call.f32
    b, d, l, n, g, nc = call.b, call.d, call.l, call.n, call.g, call.nc
    ckpt, _, sdl = _states(call)
    gout = torch.zeros(b, d, l, device=u.device) if grads[0] is None else dense(grads[0])
    glast = torch.zeros(b, d, n, device=u.device) if grads[1] is None else grads[1].to(torch.float32).contiguous()
    gl, gend = f32(b, nc, d, n), f32(b, nc, d, n)
    call.run(R.ADJ_LOCAL, R.render_adjoint_local, call.inputs() + [gout, gl])
    dinit = f32(b, d, n) if r.has_init else None
    call.run(R.ADJ_COMBINE, R.render_adjoint_combine,
             [call.A, sdl, gl, glast, gend] + ([dinit] if r.has_init else []), chunks=False)
    du, ddelta, dA = f32(b, d, l), f32(b, d, l), f32(b, nc, d, n)
    dz = f32(b, d, l) if r.has_z else None
    dD = f32(b, nc, d) if r.has_D else None
    wave = max(1, min(nc, SCRATCH_BYTES // (4 * b * d * chunk * n)))  # chunks per launch
    scratch = f32(b, wave, d, chunk, n)
    dB, dC = torch.zeros(b, g, n, l, device=u.device), torch.zeros(b, g, n, l, device=u.device)

    def zero() -> None:
        dB.zero_()
        dC.zero_()

    def launch(kern, cfg, c0=0):
        bd = cfg.block_m
        outs = [du, ddelta, dA, dB, dC] + [t for t in (dD, dz) if t is not None]
        grid = call.grid(bd)[:2] + (min(wave, nc - c0),)
        kern.launch(grid, call.inputs() + [ckpt, gend, scratch, gout] + outs + [c0] + call.sizes(bd),
                    call.consts(bd), cfg)

    run_tuned(R.BWD, r, lambda: R.render_backward(r), r.summary(), call.bucket(), call.candidates(), launch,
              reset=zero)
    for c0 in range(wave, nc, wave):
        launch(*plan_of(R.BWD, r, call.bucket()), c0=c0)
    if not call.grouped:
        dB = dB.squeeze(1)
    if C.dim() == 3:
        dC = dC.squeeze(1)

    return (cast(du, u), cast(ddelta, delta), cast(dA.sum((0, 1)), A), cast(dB, B), cast(dC, C),
            None if D is None else cast(dD.sum((0, 1)), D), None if z is None else cast(dz, z),
            None if delta_bias is None else cast(ddelta.sum((0, 2)), delta_bias),
            None if initial_state is None else cast(dinit, initial_state), None)
