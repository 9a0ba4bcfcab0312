"""Launch machinery shared by the SSD forward and backward: sizes, candidate tiles, families.

A ``Family`` is one generated kernel (a name and a renderer) whose source may depend on the tile
config (``TileConfig.heads`` is unrolled into the source).  ``run_family`` renders and loads the
candidates it needs, lets autotune pick one for this shape bucket and device, and launches it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from mambac.codegen import autotune, tma
from mambac.codegen.compile import CompiledKernel, load_kernel
from mambac.codegen.kernel_ir import SSDRegion, TileConfig, cdiv, pow2
from mambac.codegen.render_common import even_tiles


@dataclass(frozen=True)
class Dims:
    """Sizes of one SSD call (padded sizes are what Triton ranges use)."""

    b: int
    l: int
    h: int
    g: int
    p: int
    n: int
    q: int

    @property
    def nc(self) -> int:
        return cdiv(self.l, self.q)

    @property
    def hpg(self) -> int:
        return self.h // self.g

    @property
    def pp(self) -> int:
        return max(16, pow2(self.p))

    @property
    def np_(self) -> int:
        return max(16, pow2(self.n))

    def bucket(self) -> str:
        return autotune.bucket_key(self.b, self.l, self.h, self.g, self.p, self.n, self.q)


@dataclass(frozen=True)
class Family:
    """A generated kernel: ``render(region, config)`` gives its source for a tile config."""

    name: str
    render: Callable[[SSDRegion, TileConfig], str]
    candidates: Callable[[Dims], list[TileConfig]]


_SOURCES: dict[tuple, str] = {}
_PLANS: dict[tuple, tuple[CompiledKernel, TileConfig]] = {}


def source_of(fam: Family, region: SSDRegion, cfg: TileConfig) -> str:
    key = (fam.name, region, cfg.heads, cfg.tma)
    if key not in _SOURCES:
        _SOURCES[key] = fam.render(region, cfg)
    return _SOURCES[key]


def kernel_of(fam: Family, region: SSDRegion, cfg: TileConfig) -> CompiledKernel:
    """Load (render -> write -> import) the kernel of ``fam`` for this config's source."""
    src = source_of(fam, region, cfg)
    return load_kernel(fam.name, lambda: src, region.summary())


Launch = Callable[[CompiledKernel, TileConfig], Any]


def run_family(fam: Family, region: SSDRegion, dims: Dims, launch: Launch,
               tuning_launch: Optional[Callable[[], Launch]] = None) -> Any:
    """Choose a config (autotune stage) and launch; returns what ``launch`` returns.

    The choice is remembered per (kernel, region, sizes), so later calls go straight to the
    launch: generated kernels are called many times per training step.  A kernel that writes
    over its own input must not be timed on the caller's data: ``tuning_launch`` then makes (once,
    and only if candidates are timed) the launch autotune runs instead, on scratch buffers.
    """
    plan = _PLANS.get((fam.name, region, dims))
    if plan is not None:
        return launch(*plan)
    cands = fam.candidates(dims)
    family = autotune.family_key(fam.name, [source_of(fam, region, c) for c in cands], cands)
    timed: list[Launch] = []

    def bench(cfg: TileConfig) -> float:
        if not timed:
            timed.append(tuning_launch() if tuning_launch is not None else launch)
        kern = kernel_of(fam, region, cfg)
        return autotune.time_ms(lambda: timed[0](kern, cfg))

    cfg = autotune.choose(family, dims.bucket(), cands, bench)
    kernel = kernel_of(fam, region, cfg)
    _PLANS[(fam.name, region, dims)] = (kernel, cfg)
    return launch(kernel, cfg)


def _divisors(n: int, options: tuple[int, ...]) -> list[int]:
    return [o for o in options if n % o == 0]


# (heads, block_m, block_k, num_warps, num_stages, maxnreg): the fastest tiles measured on an H200
# at headdim 64 / dstate 128 (benchmarks/NOTES_ssd.md, v5 and v6), best first.  Chunk scan at S1 /
# S2 (us, v6): 1 head 64 x 32 at 2 stages 252 / 343, at 3 stages 272 / 369; dropped: 2 heads 64 x 64
# 282 / 380, a 128-register cap (no change), 1 head 64 x 64 378 / 508 and 128 rows at 8 warps 459 /
# 624 (v5).  dx: 1 head 64 x 32, 2 stages under a 128-register cap 309 / 425, 3 stages uncapped
# 344 / 468; dropped: 2 stages uncapped 356 / 491, 2 heads 379 / 518, 64 x 64 465 / 625 (v5).
_HEAD_BLOCK_TILES = ((1, 64, 32, 4, 2, None), (1, 64, 32, 4, 3, None))
_DX_TILES = ((1, 64, 32, 4, 2, 128), (1, 64, 32, 4, 3, None))


def _head_tiles(d: Dims, table: tuple) -> list[TileConfig]:
    hb = _divisors(d.hpg, (4, 2, 1))
    if autotune.interpreting():
        # row tiles of two partner tiles, so that the interpreter runs the factored off-diagonal
        # partners and the masked diagonal ones in one program
        return [TileConfig(block_m=32, block_k=16, heads=min(hb[0], 2), num_warps=1)]
    big = max(d.pp, d.np_) > 128
    out = [TileConfig(block_m=bm, block_k=bk, heads=h, num_warps=w, num_stages=st, maxnreg=mr)
           for h, bm, bk, w, st, mr in table if h in hb and not (big and h > 1)]
    return out or [TileConfig(block_m=64, block_k=32, heads=1, num_warps=8, num_stages=2)]


def head_block_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of the kernels that unroll several heads of a group (chunk scan, gate backward)."""
    return _head_tiles(d, _HEAD_BLOCK_TILES)


def with_descriptors(d: Dims, tiles: list[TileConfig]) -> list[TileConfig]:
    """Where every tile stays inside its chunk and TMA is at hand (``codegen.tma``): the tiles
    loading through tensor descriptors, then the first pointer-loading tile (a fallback should a
    Triton fail to build the descriptor forms).  Otherwise ``tiles`` as they are (and the
    interpreter's single tile stays).  On an H200 (v11) every descriptor form beat its pointer
    form: chunk scan 244 -> 214 us at S1, dx 289 -> 253, dcb 247 -> 209, dC 105 -> 98, dB 109 -> 97."""
    if autotune.interpreting() or not tma.available():
        return tiles
    described = [dataclasses.replace(c, tma=True) for c in tiles if even_tiles(d, c.block_m, c.block_k)]
    return described + tiles[:1] if described else tiles


def chunk_scan_candidates(d: Dims) -> list[TileConfig]:
    """The chunk scan's tiles: ``head_block_candidates`` and their descriptor forms, and with
    descriptors also 64-wide partner tiles at two stages and at one (H200, v11: two stages 211 /
    296 us at S1 / S2 against 215 / 301 for 32-wide ones; without descriptors 64-wide tiles were
    slower, v5; v12, CUDA-graph timing: one stage 184.0 / 269.2 against 195.9 / 281.7 at two; dx,
    dcb, dC and dB lost 17-80% at one stage; 128-row tiles 232-346 / 344-505).  At 128-step chunks
    (H200, v14, S1): the 64 x 64 one-stage tile 149.9 us; 128-row tiles 215.7-287.5; a
    persistent form (several chunks per program, one whole-chunk partner tile; removed)
    205.8-312.7."""
    out = with_descriptors(d, head_block_candidates(d))
    if any(c.tma for c in out) and even_tiles(d, 64, 64):
        out += [TileConfig(block_m=64, block_k=64, heads=1, num_warps=4, num_stages=st, tma=True) for st in (2, 1)]
    return out


def dx_candidates(d: Dims) -> list[TileConfig]:
    return with_descriptors(d, _head_tiles(d, _DX_TILES))


def _stacked_heads(d: Dims, tiles: tuple) -> list[TileConfig]:
    """Two heads of a group stacked per program (``render_state_heads``; the whole headdim in one
    tile) at (block_k, num_warps, num_stages) ``tiles``, where the group's heads pair up and one
    head's (headdim x dstate) state is at most 64 x 128 (registers)."""
    if d.hpg % 2 or d.pp * d.np_ > 64 * 128:
        return []
    return [TileConfig(block_m=d.pp, block_k=bk, heads=2, num_warps=w, num_stages=st) for bk, w, st in tiles]


def chunk_state_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of the per-chunk state reductions: block_m is the headdim tile, block_k the steps,
    ``heads`` how many heads of a group one program stacks."""
    if autotune.interpreting():
        return [TileConfig(block_m=d.pp, block_k=16, num_warps=1)]
    # H200, S1 / S2 (us): 32 steps 99 / 143, 64 steps 115 / 161; a 32-wide headdim tile 190 / 257;
    # two heads stacked, 64 steps, 3 stages 89 / 126 (v9: 32 steps 103 / 142, four heads at 8
    # warps 113 / 157, at 4 warps 205-254 / 280-346); with descriptors (v11) 82.0 / 118.4, one
    # head 64 steps 81.6 / 124.2
    bp = min(d.pp, 64)
    return with_descriptors(d, _stacked_heads(d, ((64, 4, 3), (64, 4, 4))) + [
        TileConfig(block_m=bp, block_k=32, num_warps=4, num_stages=4),
        TileConfig(block_m=bp, block_k=64, num_warps=4, num_stages=3)])


def walk_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of ``ssd_state_walk`` (descriptor loads only): block_m the headdim tile, block_n the
    dstate tile, block_k the steps per block; only those whose blocks divide the chunk, headdim
    and dstate.  H200, S1 (v12): 128 steps, 64 x 64 state tiles 73.1 us, 64 x 128 76.8; 64 steps
    95.7-102.4; 3 stages 96.8-102.4; the (dstate x headdim) orientation 75.6-82.6."""
    if autotune.interpreting():
        tiles = [TileConfig(block_m=min(d.pp, 16), block_k=16, block_n=min(d.np_, 16), num_warps=1, tma=True)]
    else:
        tiles = [TileConfig(block_m=min(d.pp, 64), block_k=bk, block_n=min(d.np_, bn), num_warps=4,
                            num_stages=2, tma=True) for bk, bn in ((128, 64), (128, 128), (128, 32), (64, 32))]
    return [c for c in dict.fromkeys(tiles)
            if even_tiles(d, c.block_k) and d.pp % c.block_m == 0 and d.np_ % c.block_n == 0]


def walk_fits(d: Dims) -> bool:
    """Whether ``ssd_state_walk`` can run here: descriptors at hand and an EVEN launch."""
    return tma.available() and bool(walk_candidates(d))


def fused_fits(d: Dims) -> bool:
    """Whether the fused forward takes these sizes: one program holds a whole (headdim x dstate)
    state in fp32 registers (64 x 128 at most, 64 registers per thread at 4 warps)."""
    return d.pp * d.np_ <= 64 * 128


def fused_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of ``ssd_fused_fwd``: block_m output rows per step, block_k the steps of the state
    blocks and of the partner tiles."""
    if autotune.interpreting():
        return [TileConfig(block_m=32, block_k=16, num_warps=1)]
    # H200, S1 / S2 (us, v6): under a 168-register cap 3 stages 402 / 541, 2 stages 409-416 /
    # 555-563; uncapped (255 registers) 3 stages 467 / 632; 8 warps 688-880 / 935-1255
    return [TileConfig(block_m=64, block_k=32, num_warps=4, num_stages=3, maxnreg=168),
            TileConfig(block_m=64, block_k=32, num_warps=4, num_stages=2, maxnreg=168)]


def dstate_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of the backward's per-chunk dy^T C reduction (it holds more live tiles)."""
    if autotune.interpreting():
        return chunk_state_candidates(d)
    bp = min(d.pp, 64)
    # two heads stacked per program (as the forward's chunk states, v9): 73-76 / 98-104 us at
    # 64 or 32 steps, 4 or 8 warps, against 70 / 95 for one head: not kept; with descriptors
    # (v11) 68.0 / 93.6 against 69.9 / 95.8
    return with_descriptors(d, [TileConfig(block_m=bp, block_k=32, num_warps=4, num_stages=4),
                                TileConfig(block_m=bp, block_k=64, num_warps=8, num_stages=2)])


def cb_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of the per-chunk C B^T: block_m rows (t) by block_k columns (s) (H200: 128 x 64 at 8
    warps 19.9 / 62.2 us at S1 / S2, 64 x 64 at 4 warps 21.5 / 65.7)."""
    if autotune.interpreting():
        return [TileConfig(block_m=16, block_k=16, num_warps=1)]
    return [TileConfig(block_m=128, block_k=64, num_warps=8, num_stages=2)]


def state_pass_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of the sequential passes: block_m is the number of state entries per program."""
    if autotune.interpreting():
        return [TileConfig(block_m=256, num_warps=1)]
    return [TileConfig(block_m=bm, num_warps=4, num_stages=2) for bm in (512, 1024)]


def group_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of the dB / dC kernels: block_m rows, block_k partner positions, splits the number
    of programs that share one group's heads (the state path; the first adds the pair path)."""
    if autotune.interpreting():
        return [TileConfig(block_m=32, block_k=16, splits=_divisors(d.hpg, (2, 1))[0], num_warps=1)]
    return with_descriptors(d, [TileConfig(block_m=bm, block_k=bs, splits=s, num_warps=4, num_stages=2)
                                for bm, bs in ((64, 64), (64, 32)) for s in _divisors(d.hpg, (1, 2, 4, 8))])


def dc_candidates(d: Dims) -> list[TileConfig]:
    """dC: ``group_candidates`` and, with descriptors, an unsplit 64 x 64 tile at three stages (H200,
    v11: 88.7 / 139.2 us at S1 / S2 against 98.0 / 154.0 at two; dB at three stages was slower,
    186 / 141 against 97 / 152)."""
    out = group_candidates(d)
    if any(c.tma for c in out) and even_tiles(d, 64, 64):
        out.insert(0, TileConfig(block_m=64, block_k=64, num_warps=4, num_stages=3, tma=True))
    return out


def dcb_candidates(d: Dims) -> list[TileConfig]:
    """Tiles of ``ssd_dcb``: block_m the (square) pair tile, heads the head-loop unroll, splits
    the number of programs sharing one group's heads (measured on an H200 at S1: 64 / unroll 2 /
    4 warps 445 us unsplit, 376 in 2 splits, 382 in 4, 403 in 8; unroll 1 456).  Each split writes
    its own fp32 (q x q) part per chunk and group, so splits are offered only while their parts
    take at most x's bytes (bf16): splits * groups * q * 4 <= heads * headdim * 2."""
    def fits(s: int) -> bool:
        return s == 1 or s * d.g * d.q * 4 <= d.h * d.p * 2
    if autotune.interpreting():
        sp = _divisors(d.hpg, (2, 1))[0]
        return [TileConfig(block_m=16, heads=2 if (d.hpg // sp) % 2 == 0 else 1, splits=sp, num_warps=1)]
    tiles = [(s, 2) for s in _divisors(d.hpg, (1, 2, 4, 8)) if fits(s)] + [(1, 1)]
    # a 168-register cap (3 CTAs per SM instead of 2): S1 343 -> 314 us, S2 544 -> 440 (v6)
    return with_descriptors(d, [TileConfig(block_m=64, heads=u, splits=s, num_warps=4, num_stages=2,
                                           maxnreg=168) for s, u in tiles if (d.hpg // s) % u == 0])


def dt_backward_candidates(d: Dims) -> list[TileConfig]:
    """``ssd_dt_backward``: blocks of ``heads`` heads as (positions x heads) tiles.  At S1 on an H200
    (NOTES_ssd.md, v9): 8 heads 22.5 us, 4 heads 28.6, 16 heads 29.1 (all at 8 warps; the former
    one-head form, dt and ddt strided by the heads, 28.3); 16 heads only where there are more
    than 8.  At 8 warps (sm_90 ptxas, chunk 256): 4 heads 48 registers, 8 heads 170, 16 heads 247."""
    if autotune.interpreting():
        return [TileConfig(heads=2, num_warps=1)]
    return [TileConfig(heads=hb, num_warps=8) for hb in (8, 4, 16) if hb <= max(8, pow2(d.h))]
