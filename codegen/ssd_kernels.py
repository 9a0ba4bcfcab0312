"""Generated-kernel implementation of ``mambac::ssd``: forward launcher and CUDA registration.

``ssd_forward`` runs the forward kernels of ``render_fwd`` (see there for what each does; the
states by ``render_state_walk``'s walk where it fits) for the region its arguments describe;
``ssd_backward`` (``ssd_kernels_bwd.py``) the backward.
``mambac.codegen.wiring`` registers both as the device kernels of ``mambac::ssd``; calls the
kernels cannot take (float64, CPU tensors outside the interpreter) run the op's reference.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from mambac.codegen import render_fused, render_fwd, render_state_walk, tma
from mambac.codegen.autotune import interpreting
from mambac.codegen.kernel_ir import KERNEL_DTYPES, SSDRegion, TileConfig, region_for
from mambac.codegen.render_common import even_tiles
from mambac.codegen.streams import Branch
from mambac.codegen.ssd_launch import (Dims, Family, cb_candidates, cdiv, chunk_scan_candidates,
                                       chunk_state_candidates, fused_candidates, fused_fits, run_family,
                                       state_pass_candidates, walk_candidates, walk_fits)
from mambac.knobs import knobs

CHUNK_CB = Family("ssd_chunk_cb", lambda r, c: render_fwd.render_chunk_cb(r), cb_candidates)
CHUNK_CB_BOTH = Family(render_fwd.chunk_cb_name(True), lambda r, c: render_fwd.render_chunk_cb(r, True),
                       cb_candidates)
CHUNK_STATE = Family("ssd_chunk_state",
                     lambda r, c: render_fwd.render_chunk_state(r, "forward", c.heads, c.tma),
                     chunk_state_candidates)
STATE_PASS = Family("ssd_state_pass", lambda r, c: render_fwd.render_state_pass(r),
                    state_pass_candidates)
CHUNK_SCAN = Family("ssd_chunk_scan",
                    lambda r, c: render_fwd.render_chunk_scan(r, c.heads, "forward", c.tma),
                    chunk_scan_candidates)
CHUNK_SCAN_FOLD = Family(render_fwd.chunk_scan_name("forward", True),
                         lambda r, c: render_fwd.render_chunk_scan(r, c.heads, "forward", c.tma, fold=True),
                         chunk_scan_candidates)
FUSED = Family(render_fused.NAME, lambda r, c: render_fused.render_fused_forward(r), fused_candidates)
STATE_WALK = Family(render_state_walk.NAME, lambda r, c: render_state_walk.render_state_walk(r), walk_candidates)
FORWARD_PATHS = ("walk", "three", "fused")


@dataclass
class SSDSaved:
    """Forward intermediates the backward can reuse instead of recomputing.

    dtp, cs: (batch, heads, nchunks*chunk) fp32; sin: states entering each chunk (batch,
    nchunks, heads, headdim, dstate) in the io dtype; cb: C B^T per chunk and group (batch,
    nchunks, groups, chunk, chunk) fp32, or None (autograd does not keep it: ``with_cb`` forms it
    again in the backward, one cheap launch); cbt: its transpose B C^T, which only the backward
    reads (``with_cb`` forms it).  ``sin`` is None after a forward asked not to save
    (inference).
    """

    dtp: Tensor
    cs: Tensor
    sin: Optional[Tensor]
    cb: Optional[Tensor] = None
    cbt: Optional[Tensor] = None


@dataclass(frozen=True)
class Prepared:
    """Inputs laid out as the generated kernels expect, plus the region and sizes."""

    region: SSDRegion
    dims: Dims
    x: Tensor
    dt: Tensor
    A: Tensor
    B: Tensor
    C: Tensor
    D: Optional[Tensor]
    z: Optional[Tensor]
    dt_bias: Optional[Tensor]
    init: Optional[Tensor]
    dt_min: float
    dt_max: float


def _dense_last(t: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    if t is None:
        return None
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


AUTO_CHUNK = 128


def kernel_chunk(chunk_size: int) -> int:
    """The chunk length the kernels run at for a model's ``chunk_size`` (``MAMBAC_SSD_CHUNK``).

    The chunked scan computes the same function at any chunk length; the length trades the
    quadratic work inside each chunk against the per-chunk states.  "auto" runs at most
    ``AUTO_CHUNK`` steps: on an H200 (benchmarks/NOTES_ssd.md, v13) a 256-step model ran its
    forward / forward+backward at S1 in 261 / 1072 us with 256-step chunks, 234 / 927 with 128
    and 306 / 1199 with 64 (S2: 474 / 1800, 504 / 1744, 692 / 2141).  "model" keeps the model's
    length; a number N runs at N."""
    choice = knobs().ssd_chunk
    if choice == "model":
        return int(chunk_size)
    if choice == "auto":
        return min(int(chunk_size), AUTO_CHUNK)
    return int(choice)


def prepare(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor],
            z: Optional[Tensor], dt_bias: Optional[Tensor], initial_state: Optional[Tensor],
            chunk_size: int, dt_softplus: bool, dt_min: float, dt_max: float) -> Prepared:
    """Cast B/C to x's dtype, make innermost dims dense, and describe the region (its chunk length
    ``kernel_chunk(chunk_size)``)."""
    chunk_size = kernel_chunk(chunk_size)
    # the interpreter cannot multiply half types (see SSDRegion.dot_precision)
    upcast = interpreting() and x.dtype in (torch.bfloat16, torch.float16)
    region = region_for(x, chunk_size, D=D, z=z, dt_bias=dt_bias, initial_state=initial_state,
                        dt_softplus=dt_softplus, dt_min=dt_min, dt_max=dt_max,
                        dot_precision="upcast" if upcast else "auto")
    b, l, h, p = x.shape
    dims = Dims(b=b, l=l, h=h, g=B.shape[2], p=p, n=B.shape[3], q=int(chunk_size))
    return Prepared(region=region, dims=dims, x=_dense_last(x), dt=dt, A=A.contiguous(),
                    B=_dense_last(B, x.dtype), C=_dense_last(C, x.dtype),
                    D=None if D is None else D.contiguous(), z=_dense_last(z, x.dtype),
                    dt_bias=None if dt_bias is None else dt_bias.contiguous(),
                    init=None if initial_state is None else initial_state.contiguous(),
                    dt_min=float(dt_min), dt_max=float(dt_max))


def strides3(t: Tensor) -> list[int]:
    return [t.stride(0), t.stride(1), t.stride(2)]


def dt_extra_args(pr: Prepared) -> list:
    """The dt prologue's arguments after dt and A that the region uses (``render_common.dt_args``)."""
    r = pr.region
    return ([pr.dt_bias] if r.has_dt_bias else []) + ([pr.dt_min, pr.dt_max] if r.dt_clamp else [])


def dense_out(pr: Prepared, dtype: torch.dtype) -> Tensor:
    """An uninitialised (batch, seq, heads, headdim) tensor like x."""
    d = pr.dims
    return torch.empty(d.b, d.l, d.h, d.p, device=pr.x.device, dtype=dtype)


def dt_buffers(pr: Prepared) -> tuple[Tensor, Tensor]:
    """Uninitialised dt' and dA-cumsum buffers, (batch, heads, nchunks*chunk) fp32 each."""
    d = pr.dims
    dtp = torch.empty(d.b, d.h, d.nc * d.q, device=pr.x.device, dtype=torch.float32)
    return dtp, torch.empty_like(dtp)


def run_chunk_state(pr: Prepared) -> tuple[Tensor, Tensor, Tensor]:
    """Kernel 1: per-chunk states (fp32), processed dt and the dA cumsum."""
    d, r = pr.dims, pr.region
    dtp, cs = dt_buffers(pr)
    states = torch.empty(d.b, d.nc, d.h, d.p, d.n, device=pr.x.device, dtype=torch.float32)

    def launch(kern, cfg: TileConfig) -> None:
        args = [pr.x, pr.dt, pr.A, pr.B] + dt_extra_args(pr) + [states, dtp, cs, d.l, d.h, d.hpg, d.nc, d.p, d.n]
        args += strides3(pr.x) + strides3(pr.dt) + strides3(pr.B)
        args += tma.launch_descriptors(cfg, even_tiles(d, cfg.block_m, cfg.block_k), "chunk state", [
            (pr.x, 2, (cfg.block_k, cfg.heads * cfg.block_m)), (pr.B, 2, (cfg.block_k, d.n))])
        kern.launch((d.nc, d.b * d.h // cfg.heads, cdiv(d.p, cfg.block_m)), args,
                    dict(BT=cfg.block_k, BP=cfg.block_m, NP=d.np_), cfg)

    run_family(CHUNK_STATE, r, d, launch)
    return states, dtp, cs


def run_chunk_cb(pr: Prepared, transposed: bool = False,
                 dtype: torch.dtype = torch.float32) -> Tensor | tuple[Tensor, Tensor]:
    """Kernel 0: C B^T inside each chunk, per group, accumulated in fp32 and stored as ``dtype``
    (zeros in tile pairs above the diagonal); with ``transposed`` a (C B^T, B C^T) pair from one
    launch."""
    d, r = pr.dims, pr.region
    out = [torch.empty(d.b, d.nc, d.g, d.q, d.q, device=pr.x.device, dtype=dtype)
           for _ in range(1 + transposed)]

    def launch(kern, cfg: TileConfig) -> None:
        grid = (cdiv(d.q, cfg.block_m) * cdiv(d.q, cfg.block_k), d.nc, d.b * d.g)
        kern.launch(grid, [pr.B, pr.C] + out + [d.l, d.g, d.nc, d.n] + strides3(pr.B) + strides3(pr.C),
                    dict(BM=cfg.block_m, BK=cfg.block_k, NP=d.np_), cfg)

    run_family(CHUNK_CB_BOTH if transposed else CHUNK_CB, r, d, launch)
    return tuple(out) if transposed else out[0]


def with_cb(pr: Prepared, saved: "SSDSaved") -> "SSDSaved":
    """``saved`` with the products the backward reads: C B^T and its transpose B C^T (dx reads the
    transpose along its rows; both come from one launch unless ``saved`` has both already)."""
    if saved.cb is not None and saved.cbt is not None:
        return saved
    cb, cbt = run_chunk_cb(pr, transposed=True)
    return dataclasses.replace(saved, cb=cb, cbt=cbt)


def final_buffer(pr: Prepared, final: Optional[Tensor] = None) -> Tensor:
    """Where the states' launches write the final state: ``final`` when given ((batch, heads,
    headdim, dstate) fp32, dense but for its batch stride), else a new dense tensor.  Wider rows
    are context parallelism's summary rows: the state walk also writes each head's total
    log-decay right after a row's states (the per-chunk path leaves that to its caller)."""
    d = pr.dims
    if final is None:
        return torch.empty(d.b, d.h, d.p, d.n, device=pr.x.device, dtype=torch.float32)
    if (tuple(final.shape) != (d.b, d.h, d.p, d.n) or final.dtype != torch.float32
            or final.stride()[1:] != (d.p * d.n, d.n, 1)):
        raise ValueError(f"the final state's buffer must be ({d.b}, {d.h}, {d.p}, {d.n}) fp32, dense but for its "
                         f"batch stride; got {tuple(final.shape)} {final.dtype} strides {final.stride()}")
    return final


def run_state_pass(pr: Prepared, states: Tensor, cs: Tensor,
                   final: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Kernel 2: the state entering each chunk (io dtype) and the final state (fp32, into
    ``final`` when given: see ``final_buffer``)."""
    d, r = pr.dims, pr.region
    sin = torch.empty(states.shape, device=states.device, dtype=r.torch_io)
    final = final_buffer(pr, final)
    init = [pr.init] if r.has_initial_state else []

    def launch(kern, cfg: TileConfig) -> None:
        kern.launch((cdiv(d.p * d.n, cfg.block_m), d.b * d.h),
                    [states, sin, cs] + init + [final, final.stride(0), d.h, d.nc, d.p * d.n],
                    dict(BLK=cfg.block_m), cfg)

    run_family(STATE_PASS, r, d, launch)
    return sin, final


def walk_buffers(pr: Prepared, final: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """What ``ssd_state_walk`` writes: the states entering each chunk (io dtype), the final state
    (fp32; ``final`` when given: see ``final_buffer``), dt' and the dA cumsum."""
    d, r = pr.dims, pr.region
    dtp, cs = dt_buffers(pr)
    sin = torch.empty(d.b, d.nc, d.h, d.p, d.n, device=pr.x.device, dtype=r.torch_io)
    return sin, final_buffer(pr, final), dtp, cs


def run_state_walk(pr: Prepared, bufs: Optional[tuple] = None, lo: int = 0,
                   hi: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Kernels 1 + 2 as one walk (``render_state_walk``) over chunks ``lo`` .. ``hi`` (default: all)
    into ``bufs`` (default: new ``walk_buffers``); a walk from ``lo`` > 0 goes on from the state
    ``final`` holds, the one the walk up to ``lo`` left there.  Returns the buffers."""
    d, r = pr.dims, pr.region
    sin, final, dtp, cs = bufs if bufs is not None else walk_buffers(pr)
    hi = d.nc if hi is None else hi
    init = [pr.init] if r.has_initial_state else []

    def launch(kern, cfg: TileConfig) -> None:
        args = [pr.dt, pr.A] + dt_extra_args(pr) + init + [sin, final, final.stride(0), dtp, cs, d.l, d.h, d.hpg,
                                                            d.nc, lo, hi]
        args += strides3(pr.dt) + tma.launch_descriptors(cfg, even_tiles(d, cfg.block_k), "state walk", [
            (pr.x, 2, (cfg.block_k, cfg.block_m)), (pr.B, 2, (cfg.block_k, cfg.block_n)),
            (sin, 4, (cfg.block_m, cfg.block_n))])
        kern.launch(((d.p // cfg.block_m) * (d.n // cfg.block_n), d.b * d.h), args,
                    dict(BT=cfg.block_k, BP=cfg.block_m, BN=cfg.block_n, P=d.p, N=d.n), cfg)

    run_family(STATE_WALK, r, d, launch)
    return sin, final, dtp, cs


def run_states(pr: Prepared, path: str, final: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(states entering each chunk, final state, dt', dA cumsum) by ``path``: "walk" (one
    launch) or "three" (the per-chunk states, then their passing); the final state into
    ``final`` when given (see ``final_buffer``)."""
    if path == "walk":
        return run_state_walk(pr, walk_buffers(pr, final))
    states, dtp, cs = run_chunk_state(pr)
    sin, final = run_state_pass(pr, states, cs, final)
    return sin, final, dtp, cs


def choose_walk(pr: Prepared) -> str:
    """"walk" or "three" for the states of either direction: "walk" where the walk can run
    (``walk_fits``) and ``MAMBAC_SSD_WALK`` allows it ("1": always there, "0": never), and, by
    default, where its programs fill the GPU: at least two per SM at 64 x 64 state tiles (one
    program per (batch, head, state tile) walks the whole sequence, so the walk's parallelism is
    fixed by the sizes).  Measured on an H200 (132 SMs; benchmarks/NOTES_ssd.md, v12): S1, 384
    programs, forward walk 70 us against 118 for the per-chunk states and their passing,
    backward 111 against 118; S2, 128 programs, forward 183 against 175, backward 274 against 187.
    Under the interpreter the walk is taken wherever it runs.  Remembered per (sizes, knobs, device)."""
    key = (pr.dims, knobs().ssd_walk, knobs().tma, pr.x.device, interpreting())
    if key not in _WALK_CHOICES:
        _WALK_CHOICES[key] = _choose_walk(pr)
    return _WALK_CHOICES[key]


_WALK_CHOICES: dict[tuple, str] = {}


def _choose_walk(pr: Prepared) -> str:
    choice = knobs().ssd_walk
    if choice == "0" or not walk_fits(pr.dims):
        return "three"
    if choice == "1" or interpreting():
        return "walk"
    return "walk" if walk_fills(pr) else "three"


def walk_fills(pr: Prepared) -> bool:
    """Whether the walk's programs (one per batch, head and 64 x 64 state tile) number at least
    two per SM."""
    d = pr.dims
    programs = d.b * d.h * max(1, d.pp // 64) * max(1, d.np_ // 64)
    return programs >= 2 * _multiprocessors(pr.x.device)


def forward_path(pr: Prepared) -> str:
    """The forward's states: ``choose_walk``'s choice, except that by default (``MAMBAC_SSD_WALK``
    auto) the forward takes the walk wherever it runs, pipelined in segments
    (``walk_segments``) where its programs alone would not fill the GPU."""
    path = choose_walk(pr)
    if path == "three" and knobs().ssd_walk == "auto" and walk_fits(pr.dims):
        return "walk"
    return path


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def scan_args(pr: Prepared) -> list:
    """The shared tail of the chunk-scan style kernels' arguments (sizes and strides)."""
    d = pr.dims
    out = [d.l, d.h, d.hpg, d.nc, d.p, d.n] + strides3(pr.x) + strides3(pr.C)
    return out + (strides3(pr.z) if pr.region.has_z else [])


def run_chunk_scan(pr: Prepared, dtp: Tensor, cs: Tensor, sin: Tensor, cb: Tensor,
                   y: Optional[Tensor] = None, lo: int = 0, hi: Optional[int] = None,
                   fold: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> Tensor:
    """Kernel 3: y for chunks ``lo`` .. ``hi`` (default: all; into ``y`` when given), with the D
    skip and z gate fused.  ``fold`` (context parallelism): (fs, fw, out), the incoming state's
    part added to the zero-start states ``sin`` as a second dot (``render_fwd.render_chunk_scan``);
    the folded states are stored in ``out``."""
    d, r = pr.dims, pr.region
    y = dense_out(pr, pr.x.dtype) if y is None else y
    hi = d.nc if hi is None else hi
    head = [pr.x, cb, pr.C] + ([pr.z] if r.has_z else []) + ([pr.D] if pr.D is not None else [])
    folds = list(fold) if fold is not None else []

    def launch(kern, cfg: TileConfig) -> None:
        even = even_tiles(d, cfg.block_m, cfg.block_k)
        descs = tma.launch_descriptors(cfg, even, "chunk scan", [
            (pr.x, 2, (cfg.block_k, d.p)), (pr.C, 2, (cfg.block_m, d.n)), (sin, 4, (d.p, d.n)),
            (cb, 4, (cfg.block_m, cfg.block_k)), (y, 2, (cfg.block_m, d.p))]
            + ([(fold[0], 3, (d.p, d.n))] if fold is not None else []))
        kern.launch((cdiv(d.q, cfg.block_m), hi - lo, d.b * d.h // cfg.heads),
                    head + [y, dtp, cs, sin] + folds + [lo] + scan_args(pr) + descs,
                    dict(BM=cfg.block_m, BK=cfg.block_k, PP=d.pp, NP=d.np_, EVEN=even), cfg)

    run_family(CHUNK_SCAN if fold is None else CHUNK_SCAN_FOLD, r, d, launch)
    return y


def walk_segments(pr: Prepared) -> list[tuple[int, int]]:
    """The chunk ranges of the forward's pipelined walk (``MAMBAC_SSD_SEGMENTS``): the walk over
    segment i + 1 runs beside the chunk scan of segment i, so the scan's programs fill the SMs that
    the walk's few programs leave idle.  "auto": one segment where the walk's programs fill the
    GPU (``walk_fills``) and off CUDA, else SEGMENTS_AUTO (at least two chunks each); N: N
    segments of near-equal chunk counts (at most one per chunk).  H100, CUDA graphs
    (benchmarks/NOTES_ssd.md, v13): S2 (128 programs) forward 569 us in one segment, 446 in
    four, 460 in eight (596 by the per-chunk states); S1 (384 programs) 262 in one, 268 / 294 /
    321 in two / four / eight (the walk already fills the SMs, and every segment boundary
    waits for the slower of the two)."""
    nc, choice = pr.dims.nc, knobs().ssd_segments
    if choice == "auto":
        k = SEGMENTS_AUTO if _on_gpu(pr) and not walk_fills(pr) else 1
        k = max(1, min(k, nc // 2))
    else:
        k = min(int(choice), nc)
    bounds = [nc * i // k for i in range(k + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


SEGMENTS_AUTO = 4


def _on_gpu(pr: Prepared) -> bool:
    return pr.x.is_cuda and not interpreting()


def scan_cb_dtype(pr: Prepared) -> torch.dtype:
    """The dtype of the C B^T that the forward's chunk scan reads: the io dtype.  The scan rounds
    each decayed weight to the io dtype before its dot anyway; storing C B^T that way halves the
    bytes each partner step loads (the scan's largest stream, re-read by every head of the group)
    and the shared memory its tile takes.  The backward computes its own fp32 product."""
    return pr.region.torch_io


def run_fused_forward(pr: Prepared, cb: Tensor, save: bool) -> tuple[Tensor, Tensor, SSDSaved]:
    """Chunk state, state passing and chunk scan in one launch (``render_fused``): y, the final
    state and the intermediates (the states entering each chunk only when ``save``)."""
    d, r, dev = pr.dims, pr.region, pr.x.device
    y = dense_out(pr, pr.x.dtype)
    dtp, cs = dt_buffers(pr)
    sin = torch.empty(d.b, d.nc, d.h, d.p, d.n, device=dev, dtype=r.torch_io) if save else None
    final = torch.empty(d.b, d.h, d.p, d.n, device=dev, dtype=torch.float32)
    ring = torch.empty(d.b * d.h * 2, d.p, d.n, device=dev, dtype=torch.float32)
    head = [pr.x, pr.dt, pr.A, pr.B] + dt_extra_args(pr) + [cb, pr.C] + ([pr.z] if r.has_z else [])
    # without save the kernel never touches sin_ptr: y stands in for it
    head += ([pr.D] if pr.D is not None else []) + [y, dtp, cs, y if sin is None else sin]
    head += [pr.init] if r.has_initial_state else []

    def launch(kern, cfg: TileConfig) -> None:
        sync = torch.zeros(1 + d.b * d.h, device=dev, dtype=torch.int32)  # ticket counter, flags
        args = head + [final, ring, sync, d.b * d.h, d.l, d.h, d.hpg, d.nc, d.p, d.n]
        args += strides3(pr.x) + strides3(pr.dt) + strides3(pr.B) + strides3(pr.C)
        args += strides3(pr.z) if r.has_z else []
        kern.launch((d.nc * d.b * d.h,), args,
                    dict(BM=cfg.block_m, BK=cfg.block_k, PP=d.pp, NP=d.np_, SAVE=save), cfg)

    run_family(FUSED, r, d, launch)
    return y, final, SSDSaved(dtp=dtp, cs=cs, sin=sin, cb=cb)


def forward_prepared(pr: Prepared, save: bool = True,
                     path: Optional[str] = None) -> tuple[Tensor, Tensor, SSDSaved]:
    """The forward launches after C B^T, by ``path`` (None: ``forward_path``'s "walk" or "three"):

    * "walk": the states by one walk over the sequence (``ssd_state_walk``), then the chunk scan,
      both in the segments of ``walk_segments``; only where ``walk_fits`` (tensor descriptors, an
      EVEN launch);
    * "three": chunk state, state passing and chunk scan as three launches;
    * "fused": one launch (``ssd_fused_fwd``), where one program's registers hold a whole state
      (``fused_fits``).  On an H200 it measured level with "three" (S2) or a few percent slower
      (S1): benchmarks/NOTES_ssd.md, v6.
    """
    if path is None:
        path = forward_path(pr)
    if path not in FORWARD_PATHS:
        raise ValueError(f"path must be one of {FORWARD_PATHS}, got {path!r}")
    if path == "fused" and not fused_fits(pr.dims):
        raise ValueError(f"the fused forward holds a (headdim x dstate) state per program, at most "
                         f"64 x 128; got {pr.dims.p} x {pr.dims.n}: use path='three'")
    if path == "walk" and not walk_fits(pr.dims):
        raise ValueError("the state walk loads its tiles through tensor descriptors and needs an EVEN "
                         "launch (the length a multiple of the chunk, power-of-two headdim and dstate, "
                         "a GPU of compute capability 9.0 or the interpreter, MAMBAC_TMA on): use path='three'")
    if path == "fused":
        return run_fused_forward(pr, run_chunk_cb(pr), save)
    branch = Branch(pr.x.device)   # C B^T beside the states (streams.py)
    with branch.run():
        cb = run_chunk_cb(pr, dtype=scan_cb_dtype(pr))
    segments = walk_segments(pr) if path == "walk" else [(0, pr.dims.nc)]
    if len(segments) == 1:
        sin, final, dtp, cs = run_states(pr, path)
        branch.join()
        y = run_chunk_scan(pr, dtp, cs, sin, cb)
        return y, final, SSDSaved(dtp=dtp, cs=cs, sin=sin, cb=cb)
    bufs = sin, final, dtp, cs = walk_buffers(pr)
    y = dense_out(pr, pr.x.dtype)
    for lo, hi in segments:
        run_state_walk(pr, bufs, lo, hi)
        with branch.run():   # after this segment's walk: its chunk scan, beside the next walk
            run_chunk_scan(pr, dtp, cs, sin, cb, y, lo, hi)
    branch.join()
    return y, final, SSDSaved(dtp=dtp, cs=cs, sin=sin, cb=cb)


def ssd_forward(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional[Tensor] = None,
                z: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                initial_state: Optional[Tensor] = None, chunk_size: int = 256,
                dt_softplus: bool = False, dt_min: float = 0.0, dt_max: float = math.inf,
                return_saved: bool = False):
    """``mambac::ssd`` forward with generated kernels: (y, final_state[, SSDSaved])."""
    pr = prepare(x, dt, A, B, C, D, z, dt_bias, initial_state, chunk_size, dt_softplus, dt_min, dt_max)
    y, final, saved = forward_prepared(pr, save=return_saved)
    return (y, final, saved) if return_saved else (y, final)


def kernels_support(x: Tensor, *others: Optional[Tensor]) -> bool:
    """Whether the generated kernels take these inputs (else the reference runs)."""
    tensors = [x] + [t for t in others if t is not None]
    if any(t.dtype == torch.float64 for t in tensors):
        return False
    if x.dtype not in KERNEL_DTYPES:
        return False
    return all(t.device == x.device for t in tensors)


def register_cuda_kernels() -> None:
    """Register the generated kernels (forward and backward) of every op with kernels as their
    device kernels (``mambac.codegen.wiring``; idempotent).  ``mambac.ops`` does this by itself
    on first use, so calling it is only needed to inspect ``registered_device_kernels()``."""
    import importlib
    importlib.import_module("mambac.codegen.wiring")
