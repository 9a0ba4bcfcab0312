"""Generated SSD kernels, forward and backward, under the Triton interpreter vs a float64 referee.

Inputs are fresh random draws per case; half-precision cases round the inputs (and the output
cotangent) to that dtype first, so the comparison measures the kernels' own rounding only.
Tolerances: fp32 1e-4, bf16 1e-2 (relative, in norm).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math

import pytest
import torch

from mambac import knobs
from mambac.codegen import SSDSaved, ssd_backward, ssd_forward, ssd_triton
from tests.codegen.referee import ssd_referee
from tests.codegen.referee import check_grads
from tests.helpers import rel_err

pytestmark = pytest.mark.interp

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state")
HALF = ("x", "dt", "B", "C", "z")  # inputs given in the io dtype; the rest stay fp32
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def make_inputs(seed, b, l, h, p, n, g, *, D=None, z=False, init=False, bias=False, softplus=True,
                dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    dt = r(b, l, h) * 0.5 - 1.0 if softplus else r(b, l, h).abs() * 0.3 + 0.05
    vals = {"x": r(b, l, h, p), "dt": dt, "A": -torch.rand(h, generator=gen) * 2 - 0.5,
            "B": r(b, l, g, n), "C": r(b, l, g, n),
            "D": None if D is None else (r(h) if D == "head" else r(h, p)),
            "z": r(b, l, h, p) if z else None, "dt_bias": r(h) * 0.3 if bias else None,
            "initial_state": r(b, h, p, n) if init else None}
    for k in HALF:
        if vals[k] is not None:
            vals[k] = vals[k].to(dtype)
    return [vals[k] for k in NAMES]


@contextlib.contextmanager
def only_tile(monkeypatch, module, family: str, tile):
    """Inside: ``module.<family>`` launches with ``tile`` alone (the launch plans made before and
    inside are dropped on entry and exit, so other kernels keep their own tiles)."""
    from mambac.codegen import ssd_launch
    fam = getattr(module, family)
    monkeypatch.setattr(module, family, dataclasses.replace(fam, candidates=lambda d: [tile]))
    ssd_launch._PLANS.clear()
    try:
        yield
    finally:
        ssd_launch._PLANS.clear()
        monkeypatch.setattr(module, family, fam)


def check(args, chunk, softplus, limit, seed=0):
    """Forward and all input gradients of the generated kernels against the referee."""
    lo, hi = limit
    dtype = args[0].dtype
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    y_ref, s_ref = ssd_referee(*ref_in, softplus, lo, hi)
    gen = torch.Generator().manual_seed(seed + 1)
    gy = torch.randn(y_ref.shape, generator=gen).to(dtype)
    gs = torch.randn(s_ref.shape, generator=gen)
    ((y_ref * gy.double()).sum() + (s_ref * gs.double()).sum()).backward()

    y, final, saved = ssd_forward(*args, chunk_size=chunk, dt_softplus=softplus, dt_min=lo,
                                  dt_max=hi, return_saved=True)
    assert y.dtype == dtype and final.dtype == torch.float32
    errs = {"y": rel_err(y, y_ref), "final_state": rel_err(final, s_ref)}
    grads = ssd_backward(gy, gs, *args, chunk, softplus, lo, hi, saved=saved)
    check_grads(errs, NAMES, grads, args, ref_in, TOL[dtype])
    return (y, final), grads, (gy, gs)


NOLIM = (0.0, math.inf)


@pytest.mark.parametrize("case", [
    # (b, l, h, p, n, g, chunk), flags
    dict(shape=(1, 20, 2, 4, 8, 1, 8), flags={}, softplus=False, limit=NOLIM),
    dict(shape=(2, 16, 4, 6, 5, 2, 8), flags=dict(D="head_dim", init=True, bias=True),
         softplus=True, limit=NOLIM),
    dict(shape=(1, 7, 2, 4, 4, 2, 16), flags=dict(D="head", z=True), softplus=True,
         limit=(0.05, 2.0)),
    dict(shape=(1, 30, 4, 8, 8, 1, 12), flags=dict(D="head", z=True, init=True, bias=True),
         softplus=False, limit=(0.05, 0.5)),
    dict(shape=(1, 100, 4, 4, 8, 2, 48), flags=dict(D="head", z=True, init=True), softplus=True,
         limit=NOLIM),
    # every tile inside the chunk, the sequence, headdim and dstate: the kernels' EVEN launches
    dict(shape=(1, 64, 2, 16, 16, 1, 32), flags=dict(D="head", z=True, init=True, bias=True),
         softplus=True, limit=NOLIM),
], ids=["plain-L20", "Dhd-init-bias-L16", "z-clamp-L7<chunk", "all-chunk12", "tiles-chunk48-L100",
        "even-tiles-L64"])
def test_fp32_matches_referee(case):
    b, l, h, p, n, g, q = case["shape"]
    args = make_inputs(len(str(case)), b, l, h, p, n, g, softplus=case["softplus"], **case["flags"])
    check(args, q, case["softplus"], case["limit"])


def test_bf16_matches_referee():
    args = make_inputs(5, 2, 33, 4, 8, 16, 2, D="head", z=True, init=True, bias=True,
                       dtype=torch.bfloat16)
    check(args, 16, True, NOLIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_cb_in_io_dtype(dtype):
    """The forward's C B^T (read only by its chunk scan) is stored in the io dtype; the output
    still matches the referee and the backward, which forms its own fp32 product, too."""
    args = make_inputs(9, 1, 40, 2, 8, 16, 1, D="head", z=True, dtype=dtype)
    _, _, saved = ssd_forward(*args, chunk_size=16, dt_softplus=True, return_saved=True)
    assert saved.cb.dtype == dtype
    check(args, 16, True, NOLIM, seed=9)


def test_matches_op_reference_and_autograd_wrapper():
    """Against mambac.ops.ssd's chunked reference too, and through ssd_triton's autograd."""
    ssd_ref = importlib.import_module("mambac.ops.ssd").reference
    args = make_inputs(11, 1, 19, 2, 4, 8, 1, D="head", bias=True, init=True)
    leaves = [None if a is None else a.clone().requires_grad_(True) for a in args]
    y, final = ssd_triton(*leaves[:5], chunk_size=8, D=leaves[5], z=leaves[6], dt_bias=leaves[7],
                          initial_state=leaves[8], dt_softplus=True)
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    y_ref, f_ref = ssd_ref(*ref_in, 8, True, 0.0, math.inf)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(final, f_ref) < 1e-5
    (y.sum() + final.square().sum()).backward()
    (y_ref.sum() + f_ref.square().sum()).backward()
    for name, a, r in zip(NAMES, leaves, ref_in):
        if a is not None:
            assert rel_err(a.grad, r.grad) < 1e-4, name


def test_kernel_chunk_length():
    """``MAMBAC_SSD_CHUNK``: by default the kernels run a 256-step model at 128-step chunks (shorter
    models at their own), "model" keeps the model's, a number sets it; bad values are refused
    with the knob's name.  Both lengths match the referee, forward and backward, at a length
    neither divides, and the states kept for the backward are the kernels' chunks'."""
    fk = importlib.import_module("mambac.codegen.ssd_kernels")
    assert [knobs._chunk_choice(v) for v in (None, "", "Auto", "model", "64", "0128")] == \
        ["auto", "auto", "auto", "model", "64", "128"]
    for bad in ("8", "-1", "fast", "64.5"):
        with pytest.raises(ValueError, match="MAMBAC_SSD_CHUNK"):
            knobs._chunk_choice(bad)
    with knobs.override(ssd_chunk="auto"):
        assert (fk.kernel_chunk(256), fk.kernel_chunk(128), fk.kernel_chunk(48)) == (128, 128, 48)
    with knobs.override(ssd_chunk="model"):
        assert fk.kernel_chunk(256) == 256
    with knobs.override(ssd_chunk="32"):
        assert fk.kernel_chunk(256) == 32
    args = make_inputs(17, 1, 150, 3, 4, 8, 1, D="head", z=True, init=True, bias=True)
    for choice, q in (("auto", 128), ("model", 256)):
        with knobs.override(ssd_chunk=choice):
            pr = fk.prepare(*args, 256, True, 0.0, math.inf)
            assert pr.dims.q == q and pr.region.chunk_size == q
            _, _, saved = ssd_forward(*args, chunk_size=256, dt_softplus=True, return_saved=True)
            assert saved.sin.shape[1] == math.ceil(150 / q)
            check(args, 256, True, NOLIM, seed=17)


def test_backward_recomputes_without_saved_state():
    args = make_inputs(3, 1, 12, 2, 4, 4, 1, z=True)
    dy = torch.randn(1, 12, 2, 4)
    y, final, saved = ssd_forward(*args, chunk_size=8, dt_softplus=True, return_saved=True)
    assert isinstance(saved, SSDSaved)
    with_saved = ssd_backward(dy, None, *args, 8, True, saved=saved)
    recomputed = ssd_backward(dy, None, *args, 8, True)
    for name, a, b in zip(NAMES, with_saved, recomputed):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("path", ["fused", "three"])
def test_forward_paths_match_referee(path):
    """Each way of launching the forward (one fused launch, three launches) against the referee,
    with several chunks, a partial last chunk and an initial state; the states entering each
    chunk (kept for the backward) agree between the paths."""
    fk = importlib.import_module("mambac.codegen.ssd_kernels")
    args = make_inputs(21, 2, 27, 3, 4, 8, 1, D="head", z=True, init=True, bias=True)
    x, dt, A, B, C, D, z, bias, init = args
    pr = fk.prepare(x, dt, A, B, C, D, z, bias, init, 8, True, 0.0, math.inf)
    y, final, saved = fk.forward_prepared(pr, path=path)
    y_ref, s_ref = ssd_referee(*[None if a is None else a.double() for a in args], True, 0.0, math.inf)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(final, s_ref) < 1e-5
    three = fk.forward_prepared(pr, path="three")[2]
    assert rel_err(saved.sin, three.sin) < 1e-6 and torch.equal(saved.cs, three.cs)


def test_forward_path_errors():
    """An unknown path, and the fused path on a state larger than its programs hold, are refused."""
    fk = importlib.import_module("mambac.codegen.ssd_kernels")
    pr = fk.prepare(*make_inputs(2, 1, 8, 2, 4, 4, 1), 8, True, 0.0, math.inf)
    with pytest.raises(ValueError, match="path must be one of"):
        fk.forward_prepared(pr, path="two")
    big = fk.prepare(*make_inputs(2, 1, 8, 1, 128, 128, 1), 8, True, 0.0, math.inf)
    with pytest.raises(ValueError, match="use path='three'"):
        fk.forward_prepared(big, path="fused")


@pytest.mark.parametrize("softplus,limit,flags,dtype", [
    (True, (0.05, 2.0), dict(D="head", bias=True, init=True), torch.float32),
    (False, NOLIM, dict(bias=True), torch.float32),
    (True, NOLIM, dict(D="head", z=True, bias=True), torch.bfloat16),
], ids=["softplus-clamp-bias", "plain-bias", "bf16-z"])
def test_dt_backward_head_blocks_match_referee(monkeypatch, softplus, limit, flags, dtype):
    """ssd_dt_backward with a head block that runs past the last head (6 heads in blocks of 4)
    agrees with the referee and with blocks that divide the heads (2, the interpreter's)."""
    from mambac.codegen import ssd_kernels_bwd as bk
    from mambac.codegen.kernel_ir import TileConfig
    args = make_inputs(11, 2, 45, 6, 4, 8, 2, softplus=softplus, dtype=dtype, **flags)
    q = 32  # two pair tiles per chunk (16 under the interpreter), and a partial last chunk
    y, final, saved = ssd_forward(*args, chunk_size=q, dt_softplus=softplus, dt_min=limit[0],
                                  dt_max=limit[1], return_saved=True)
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    one = ssd_backward(gy, None, *args, q, softplus, *limit, saved=saved)
    with only_tile(monkeypatch, bk, "DT_BWD", TileConfig(heads=4, num_warps=1)):
        blocks = ssd_backward(gy, None, *args, q, softplus, *limit, saved=saved)
        check(args, q, softplus, limit)
    for name, a, b in zip(NAMES, one, blocks):
        if a is not None:
            assert rel_err(b, a) <= (1e-6 if dtype == torch.float32 else 1e-2), name


@pytest.mark.parametrize("heads,g,flags,dtype", [
    (2, 1, dict(D="head", bias=True, init=True), torch.float32),
    (4, 2, dict(z=True, bias=True), torch.bfloat16),
], ids=["fp32-2heads", "bf16-4heads-2groups"])
def test_stacked_heads_chunk_state_matches_referee(monkeypatch, heads, g, flags, dtype):
    """ssd_chunk_state with several heads of a group per program (odd length, a partial last
    chunk, headdim not a power of two) agrees with the referee and with the one-head form."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen.kernel_ir import TileConfig
    args = make_inputs(13, 2, 45, 8, 6, 8, g, dtype=dtype, **flags)
    stacked = TileConfig(block_m=8, block_k=8, heads=heads, num_warps=1)
    _with_tiles_matches(monkeypatch, args, 16, [(fk, "CHUNK_STATE", stacked)], seed=0)


def _with_tiles_matches(monkeypatch, args, q, tiles, seed):
    """Under ``tiles`` ((module, family, TileConfig) triples, each launched alone): forward and
    gradients match the referee (``check``), and the default tiles' results, for the same output
    gradients, to rounding."""
    dtype = args[0].dtype
    with contextlib.ExitStack() as stack:
        for module, family, tile in tiles:
            stack.enter_context(only_tile(monkeypatch, module, family, tile))
        y, grads, (gy, gs) = check(args, q, True, NOLIM, seed=seed)
    *base_y, saved = ssd_forward(*args, chunk_size=q, dt_softplus=True, return_saved=True)
    base = ssd_backward(gy, gs, *args, q, True, 0.0, math.inf, saved=saved)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(y[0], base_y[0]) <= tol and rel_err(y[1], base_y[1]) <= tol
    _grads_close(base, grads, dtype)


def _grads_close(base, grads, dtype) -> None:
    """Two kernel paths' input gradients agree: fp32 to 1e-5 (they sum over more terms than the
    outputs, in another order on each path, and the CPU's fp32 matmuls order their reductions
    differently from one machine to another: dA came out 1.3e-6 apart on one), bf16 to 1e-2."""
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, a, b in zip(NAMES, base, grads):
        if a is not None:
            assert rel_err(b, a) <= tol, name


def _batch(dtype) -> int:
    """Sequences per case in the descriptor and walk tests: two in fp32 (the descriptors' batch
    offsets), one in bf16 (its rows and rounding; the batch addressing is the same)."""
    return 2 if dtype == torch.float32 else 1


def _split_views(args, g, pad: int):
    """x, B and C as slices of one (batch, seqlen, columns) buffer, the layout of a Mamba-2 layer's
    conv output; ``pad`` extra columns make the row stride odd-sized (not a TMA stride)."""
    x, B, C = args[0], args[3], args[4]
    b, l, h, p = x.shape
    n = B.shape[-1]
    cols = [x.reshape(b, l, h * p), B.reshape(b, l, g * n), C.reshape(b, l, g * n)]
    buf = torch.cat(cols + [torch.zeros(b, l, pad, dtype=x.dtype)], dim=-1)
    x2 = buf[..., :h * p].view(b, l, h, p)
    B2 = buf[..., h * p:h * p + g * n].view(b, l, g, n)
    C2 = buf[..., h * p + g * n:h * p + 2 * g * n].view(b, l, g, n)
    return [x2, *args[1:3], B2, C2, *args[5:]]


@pytest.mark.parametrize("dtype,pad,heads,bk,tma", [(torch.float32, 0, 1, 16, True), (torch.bfloat16, 3, 2, 16, True),
                                                  (torch.float32, 0, 1, 32, True), (torch.bfloat16, 3, 2, 32, False)],
                         ids=["fp32-views-1head", "bf16-unaligned-rows-2heads", "fp32-square-tiles",
                              "bf16-square-tiles-pointers-2heads"])
def test_descriptor_chunk_scan_matches_referee(monkeypatch, dtype, pad, heads, bk, tma):
    """The chunk scan loading C, the states, C B^T and x through tensor descriptors (``tma``) on an
    EVEN launch (two chunks of two row tiles, so both partner loops run): x, B and C are views of
    one buffer (rows a TMA can address as they are, or, with ``pad``, copied first).  Matches the
    referee, and the pointer-loading chunk scan to rounding.  Square tiles (``bk`` == block_m, the
    GPU's default at 128-step chunks) take the diagonal step outside the loops, with descriptors
    or pointer loads."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen.kernel_ir import TileConfig
    args = _split_views(make_inputs(17, _batch(dtype), 128, 4, 16, 16, 1, D="head", z=True, init=True, bias=True,
                                    dtype=dtype), 1, pad)
    tile = TileConfig(block_m=32, block_k=bk, heads=heads, num_warps=1, tma=tma)
    _with_tiles_matches(monkeypatch, args, 64, [(fk, "CHUNK_SCAN", tile)], seed=4)


def test_descriptor_chunk_scan_refuses_uneven_launch(monkeypatch):
    """The descriptor form has no bounds masks: a length that leaves a partial chunk is refused
    with a message (autotune offers it only for EVEN launches)."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen.kernel_ir import TileConfig
    args = make_inputs(19, 1, 40, 2, 16, 16, 1)
    tile = TileConfig(block_m=16, block_k=16, num_warps=1, tma=True)
    with only_tile(monkeypatch, fk, "CHUNK_SCAN", tile):
        with pytest.raises(Exception, match="EVEN launch"):
            ssd_forward(*args, chunk_size=32, dt_softplus=True)


@pytest.mark.parametrize("dtype,pad,heads", [(torch.float32, 0, 1), (torch.bfloat16, 3, 2)],
                         ids=["fp32-views-1head", "bf16-unaligned-rows-2heads"])
def test_descriptor_dx_matches_referee(monkeypatch, dtype, pad, heads):
    """dx loading B, dS, B C^T and dy through tensor descriptors (``tma``) on an EVEN launch (both
    target loops run): all gradients match the referee, dx matches the pointer form's to rounding."""
    from mambac.codegen import ssd_kernels_bwd as bk
    from mambac.codegen.kernel_ir import TileConfig
    args = _split_views(make_inputs(23, 2, 128, 4, 16, 16, 1, D="head_dim", z=True, init=True,
                                    bias=True, dtype=dtype), 1, pad)
    tile = TileConfig(block_m=32, block_k=16, heads=heads, num_warps=1, tma=True)
    _with_tiles_matches(monkeypatch, args, 64, [(bk, "DX", tile)], seed=8)


@pytest.mark.parametrize("dtype,pad", [(torch.float32, 0), (torch.bfloat16, 3)],
                         ids=["fp32-views", "bf16-unaligned-rows"])
def test_descriptor_dcb_dc_db_match_referee(monkeypatch, dtype, pad):
    """dcb, dC and dB loading their tiles through tensor descriptors (``tma``), with the group's
    heads in two splits (so dC / dB add two dCB parts), on an EVEN launch: every gradient matches
    the referee, and the pointer forms' to rounding."""
    from mambac.codegen import ssd_kernels_bwd as bk
    from mambac.codegen.kernel_ir import TileConfig
    g = 2
    args = _split_views(make_inputs(29, _batch(dtype), 128, 8, 16, 16, g, D="head", init=True, bias=True,
                                    dtype=dtype), g, pad)
    tiles = [(bk, "DCB", TileConfig(block_m=16, heads=2, splits=2, num_warps=1, tma=True))]
    tiles += [(bk, fam, TileConfig(block_m=16, block_k=bs, splits=2, num_warps=1, tma=True))
              for fam, bs in (("DC", 32), ("DB", 16))]
    _with_tiles_matches(monkeypatch, args, 64, tiles, seed=10)


@pytest.mark.parametrize("dtype,pad,heads", [(torch.float32, 0, 1), (torch.bfloat16, 3, 2)],
                         ids=["fp32-views-1head", "bf16-unaligned-rows-2heads"])
def test_descriptor_chunk_state_and_dstate_match_referee(monkeypatch, dtype, pad, heads):
    """The forward's chunk states (one head per program, or two stacked) and the backward's dstate
    loading x / dy and B / C through tensor descriptors (``tma``) on an EVEN launch: the forward
    and every gradient match the referee, and the pointer forms' to rounding."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen import ssd_kernels_bwd as bk
    from mambac.codegen.kernel_ir import TileConfig
    args = _split_views(make_inputs(31, _batch(dtype), 128, 4, 16, 16, 1, D="head", init=True, bias=True,
                                    dtype=dtype), 1, pad)
    tiles = [(fk, "CHUNK_STATE", TileConfig(block_m=16, block_k=16, heads=heads, num_warps=1, tma=True)),
             (bk, "DSTATE", TileConfig(block_m=16, block_k=32, num_warps=1, tma=True))]
    with knobs.override(ssd_walk="0"):   # the per-chunk states, not the walks
        _with_tiles_matches(monkeypatch, args, 64, tiles, seed=14)


@pytest.mark.parametrize("dtype,pad", [(torch.float32, 0), (torch.bfloat16, 3)],
                         ids=["fp32-views", "bf16-unaligned-rows"])
def test_state_walks_match_referee_and_the_per_chunk_states(dtype, pad):
    """The forward's and the backward's state walks (``render_state_walk``): two chunks of four
    step blocks, four state tiles per head (headdim and dstate 32 in 16 x 16 tiles), two groups,
    x / B / C views of one buffer.  Forward and every gradient match the referee, and the per-chunk
    states with their passing (``MAMBAC_SSD_WALK=0``) to rounding; so do the saved intermediates."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen import ssd_launch
    args = _split_views(make_inputs(37, _batch(dtype), 128, 4, 32, 32, 2, D="head", z=True, init=True, bias=True,
                                    dtype=dtype), 2, pad)
    pr = fk.prepare(*args, 64, True, 0.0, math.inf)
    with knobs.override(ssd_walk="1"):
        assert fk.choose_walk(pr) == "walk"
        y, grads, (gy, gs) = check(args, 64, True, NOLIM, seed=16)
        saved = fk.forward_prepared(pr)[2]
    assert {"ssd_state_walk", "ssd_state_walk_bwd"} <= {k[0] for k in ssd_launch._PLANS}
    ssd_launch._PLANS.clear()
    with knobs.override(ssd_walk="0"):
        assert fk.choose_walk(pr) == "three"
        *base_y, base_saved = ssd_forward(*args, chunk_size=64, dt_softplus=True, return_saved=True)
        base = ssd_backward(gy, gs, *args, 64, True, 0.0, math.inf, saved=base_saved)
    assert not {"ssd_state_walk", "ssd_state_walk_bwd"} & {k[0] for k in ssd_launch._PLANS}
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(y[0], base_y[0]) <= tol and rel_err(y[1], base_y[1]) <= tol
    _grads_close(base, grads, dtype)
    assert rel_err(saved.sin, base_saved.sin) <= tol
    assert torch.equal(saved.dtp, base_saved.dtp) and rel_err(saved.cs, base_saved.cs) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_walk_in_whole_chunk_blocks(monkeypatch, dtype):
    """The walk with one block per chunk (BT == chunk, the GPU's tile at 128-step chunks), whose
    states leave through a descriptor store: the forward, every gradient and the states entering
    each chunk match the referee and the per-chunk states to rounding."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen.kernel_ir import TileConfig
    args = _split_views(make_inputs(41, _batch(dtype), 96, 4, 32, 32, 2, D="head", z=True, init=True, bias=True,
                                    dtype=dtype), 2, 0)
    pr = fk.prepare(*args, 32, True, 0.0, math.inf)
    tile = TileConfig(block_m=16, block_k=32, block_n=16, num_warps=1, tma=True)
    with knobs.override(ssd_walk="1"), only_tile(monkeypatch, fk, "STATE_WALK", tile):
        y, grads, (gy, gs) = check(args, 32, True, NOLIM, seed=18)
        saved = fk.forward_prepared(pr)[2]
    with knobs.override(ssd_walk="0"):
        *base_y, base_saved = ssd_forward(*args, chunk_size=32, dt_softplus=True, return_saved=True)
    # fp32: the walk sums each chunk in one block, the per-chunk states in two (1.2e-6 apart seen)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(y[0], base_y[0]) <= tol and rel_err(y[1], base_y[1]) <= tol
    assert rel_err(saved.sin, base_saved.sin) <= tol


def test_state_walk_path_choice():
    """The walk is the default where it runs (here, the interpreter); it is refused with a message,
    and the default falls back to the per-chunk states, on a length that leaves a partial chunk,
    with descriptors turned off (``MAMBAC_TMA=0``) or with ``MAMBAC_SSD_WALK=0``."""
    from mambac.codegen import ssd_kernels as fk
    even = fk.prepare(*make_inputs(3, 1, 64, 2, 16, 16, 1), 32, True, 0.0, math.inf)
    partial = fk.prepare(*make_inputs(3, 1, 40, 2, 16, 16, 1), 32, True, 0.0, math.inf)
    assert fk.choose_walk(even) == "walk"
    assert fk.choose_walk(partial) == "three"
    with pytest.raises(ValueError, match="use path='three'"):
        fk.forward_prepared(partial, path="walk")
    with knobs.override(tma=False):
        assert fk.choose_walk(even) == "three"
    with knobs.override(ssd_walk="0"):
        assert fk.choose_walk(even) == "three"
    assert [knobs._walk_choice(v) for v in (None, "", "auto", "1", "on", "0", "off", "no")] == \
        ["auto", "auto", "auto", "1", "1", "0", "0", "0"]


def test_state_walk_default_fills_the_gpu(monkeypatch):
    """Off the interpreter the backward's walk is the default only where its programs (one per
    batch, head and 64 x 64 state tile) number at least two per SM: S1 (4 x 48 heads: 384
    programs) takes it on a 132-SM GPU, S2 (1 x 64 heads: 128) does not; ``MAMBAC_SSD_WALK=1``
    takes it anyway.  The forward takes the walk at both, in one segment at S1 and in four at S2."""
    from mambac.codegen import ssd_kernels as fk
    from mambac.codegen.ssd_launch import Dims
    monkeypatch.setattr(fk, "interpreting", lambda: False)
    monkeypatch.setattr(fk, "walk_fits", lambda d: True)
    monkeypatch.setattr(fk, "_multiprocessors", lambda device: 132)
    fk._WALK_CHOICES.clear()
    pr = fk.prepare(*make_inputs(3, 1, 64, 2, 16, 16, 1), 32, True, 0.0, math.inf)
    s1 = dataclasses.replace(pr, dims=Dims(b=4, l=4096, h=48, g=1, p=64, n=128, q=256))
    s2 = dataclasses.replace(pr, dims=Dims(b=1, l=16384, h=64, g=8, p=64, n=128, q=256))
    monkeypatch.setattr(fk, "_on_gpu", lambda pr: True)
    try:
        assert fk.choose_walk(s1) == "walk" and fk.choose_walk(s2) == "three"
        with knobs.override(ssd_walk="1"):
            assert fk.choose_walk(s2) == "walk"
        # the forward takes the walk at both, pipelined in segments where it would not fill the GPU
        assert fk.forward_path(s1) == "walk" and fk.walk_segments(s1) == [(0, 16)]
        assert fk.forward_path(s2) == "walk"
        assert fk.walk_segments(s2) == [(0, 16), (16, 32), (32, 48), (48, 64)]
        with knobs.override(ssd_walk="0"):
            assert fk.forward_path(s1) == "three" and fk.forward_path(s2) == "three"
        with knobs.override(ssd_segments="2"):
            assert fk.walk_segments(s1) == [(0, 8), (8, 16)]
    finally:
        fk._WALK_CHOICES.clear()


def test_pipelined_walk_segments_match_one_walk():
    """The forward's walk and chunk scan in segments (``MAMBAC_SSD_SEGMENTS``): five chunks in three
    segments of 1, 2 and 2 chunks, with an initial state (the first segment starts from it, the
    others from the state the one before left) give the one-segment forward's y, final state and
    saved intermediates exactly, and match the referee."""
    from mambac.codegen import ssd_kernels as fk
    args = make_inputs(41, 2, 160, 3, 16, 32, 1, D="head", z=True, init=True, bias=True)
    pr = fk.prepare(*args, 32, True, 0.0, math.inf)
    with knobs.override(ssd_segments="3"):
        assert fk.walk_segments(pr) == [(0, 1), (1, 3), (3, 5)]
        y, final, saved = fk.forward_prepared(pr, path="walk")
        check(args, 32, True, NOLIM, seed=42)
    with knobs.override(ssd_segments="1"):
        assert fk.walk_segments(pr) == [(0, 5)]
        y1, final1, saved1 = fk.forward_prepared(pr, path="walk")
    assert torch.equal(y, y1) and torch.equal(final, final1)
    assert torch.equal(saved.sin, saved1.sin) and torch.equal(saved.cs, saved1.cs)
    ref_y, ref_final = ssd_referee(*[a.double() if a is not None else None for a in args], True, *NOLIM)
    assert rel_err(y, ref_y) <= 1e-4 and rel_err(final, ref_final) <= 1e-4


def test_walk_segments_choice():
    """"auto" is one segment off CUDA; N segments split the chunks near-evenly, never more than
    one per chunk; anything but auto or a whole number of at least 1 is refused naming the knob."""
    from mambac.codegen import ssd_kernels as fk
    pr = fk.prepare(*make_inputs(3, 1, 96, 2, 16, 16, 1), 32, True, 0.0, math.inf)
    assert fk.walk_segments(pr) == [(0, 3)]
    with knobs.override(ssd_segments="8"):
        assert fk.walk_segments(pr) == [(0, 1), (1, 2), (2, 3)]
    with knobs.override(ssd_segments="2"):
        assert fk.walk_segments(pr) == [(0, 1), (1, 3)]
    assert [knobs._segments_choice(v) for v in (None, "", "auto", "4", " 02 ")] == ["auto", "auto", "auto", "4", "2"]
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="MAMBAC_SSD_SEGMENTS"):
            knobs._segments_choice(bad)
