"""Generated SSD source: ordered substring checks (never whole-file goldens), and every flag
combination renders to valid Python.  No kernel runs here."""
from __future__ import annotations

import ast
import itertools
import re

import pytest

from mambac.codegen import (render_bwd, render_bwd_pairs, render_bwd_tiles, render_fused, render_fwd,
                            render_state_walk)
from mambac.codegen.kernel_ir import SSDRegion
from tests.helpers import assert_in_order


def region(**kw) -> SSDRegion:
    base = dict(has_dt_bias=True, dt_softplus=True, dt_clamp=True, d_mode="head", has_z=True,
                has_initial_state=True, io_dtype="bf16", chunk_size=64)
    base.update(kw)
    return SSDRegion(**base)


def all_sources(r: SSDRegion) -> dict[str, str]:
    out = {"chunk_cb": render_fwd.render_chunk_cb(r),
           "chunk_state": render_fwd.render_chunk_state(r, "forward"),
           "dstate": render_fwd.render_chunk_state(r, "dstate"),
           "state_pass": render_fwd.render_state_pass(r),
           "chunk_scan": render_fwd.render_chunk_scan(r, 2, "forward"),
           "state_pass_bwd": render_bwd.render_state_pass_bwd(r),
           "dt_backward": render_bwd.render_dt_backward(r, 4),
           "dx": render_bwd_tiles.render_dx(r, 2),
           "dc": render_bwd_tiles.render_dbc(r, "c"), "db": render_bwd_tiles.render_dbc(r, "b"),
           "dcb": render_bwd_pairs.render_dcb(r, 2),
           "state_walk": render_state_walk.render_state_walk(r),
           "state_walk_bwd": render_state_walk.render_state_walk_bwd(r)}
    if r.has_z:
        out["gate_backward"] = render_fwd.render_chunk_scan(r, 2, "gate_backward")
    return out


FLAGS = list(itertools.product([False, True], [False, True], [False, True], ["none", "head", "head_dim"],
                               [False, True], [False, True]))


@pytest.mark.parametrize("bias,softplus,clamp,d_mode,z,init", FLAGS)
def test_every_flag_combination_is_valid_python(bias, softplus, clamp, d_mode, z, init):
    r = region(has_dt_bias=bias, dt_softplus=softplus, dt_clamp=clamp, d_mode=d_mode, has_z=z,
               has_initial_state=init)
    for name, src in all_sources(r).items():
        ast.parse(src, filename=name)
        uses = lambda arg: re.search(rf"\b{arg}\b", src) is not None  # noqa: E731
        assert uses("z_ptr") == (z and name in ("chunk_scan", "gate_backward")), name
        assert uses("d_ptr") == (d_mode != "none" and name in ("chunk_scan", "gate_backward", "dx"))
        assert uses("init_ptr") == (init and name in ("state_pass", "state_walk")), name
        assert uses("bias_ptr") == (bias and name in ("chunk_state", "dt_backward", "state_walk")), name


def test_prologue_runs_in_order_before_the_cumsum():
    src = render_fwd.render_chunk_state(region(), "forward")
    assert_in_order(src, "def _softplus(v):", "def _dt_transform(d, bias, dt_min, dt_max):",
                    "d = d + bias", "d = _softplus(d)", "tl.minimum(tl.maximum(d, dt_min), dt_max)",
                    "def ssd_chunk_state(", "_dt_transform(d, bias, dt_min, dt_max)",
                    "tl.cumsum(da, 0)", "tl.store(cs_ptr", "tl.dot(")


def test_stacked_heads_state_kernels_in_order():
    src = render_fwd.render_chunk_state(region(), "forward", 2)
    assert_in_order(src, "def _rows(v, BP: tl.constexpr):", "def ssd_chunk_state(",
                    "h0 = (pid_bh % (H // 2)) * 2", "rows = tl.arange(0, 2 * BP)",
                    "bias = tl.load(bias_ptr + h0 + hh)", "_dt_transform(d, bias, dt_min, dt_max)",
                    "tl.cumsum(da, 1)", "tl.store(cs_ptr + row[:, None] + s[None, :]",
                    "_rows(d * tl.exp(end[:, None] - cs), BP)", "_rows(tl.exp(end - run)[:, None], BP)",
                    "tl.store(states_ptr")
    with pytest.raises(ValueError, match="only the forward"):
        render_fwd.render_chunk_state(region(), "dstate", 2)


def test_absent_prologue_steps_leave_no_code():
    src = render_fwd.render_chunk_state(region(has_dt_bias=False, dt_softplus=False, dt_clamp=False))
    for absent in ("_softplus", "bias", "dt_min", "tl.log("):
        assert absent not in src
    assert_in_order(src, "def _dt_transform(d):", "return d", "tl.cumsum(da, 0)")


def test_chunk_scan_epilogue_order_and_heads_unrolled():
    src = render_fwd.render_chunk_scan(region(d_mode="head_dim"), 3, "forward")
    assert_in_order(src, "off = (pid_m * BM) // BK * BK", "acc_0 = tl.dot(c_t", "* tl.exp(cs_r_0)",
                    "acc_1 = tl.dot(c_t", "acc_2 = tl.dot(c_t",
                    # partners before the row tile: the decay factored through r, no mask
                    "for k0 in range(0, off, BK):", "cb = tl.load(cb_ptr + cb_base", "mask=in_t",
                    "wj = cb * (tl.exp(cs_r_0 - cs_s) * dt_s)[None, :]", "acc_2 = tl.dot(",
                    "acc_0 = acc_0 * tl.exp(cs_t_0 - cs_r_0)[:, None]",
                    # the diagonal partners: the full masked decay
                    "for k0 in range(off, pid_m * BM + BM, BK):", "causal = ", "cb = tl.load(cb_ptr + cb_base",
                    "tl.exp(tl.where(causal, cs_t_0[:, None] - cs_s[None, :]", "acc_2 = tl.dot(",
                    "# epilogue of head 0", "y = y + x_t * tl.load(d_ptr", "y = y * zz * sg",
                    "tl.store(y_ptr", "# epilogue of head 2")
    # one cb load per loop, and one in the diagonal's single-tile form (BK == BM, constexpr)
    assert "acc_3" not in src and src.count("cb = tl.load") == 3 and not re.search(r"\bb_ptr", src)
    assert src.count("causal = ") == 2


def test_chunk_scan_loads_partner_vectors_ahead():
    """The partners' cumsum and dt vectors are loaded a step ahead of the dot that needs them: the
    first before the loop, the next at the end of each step; with BK == BM the diagonal tile runs
    once, outside a loop, on the rows' own cumsum and a dt loaded at the start."""
    src = render_fwd.render_chunk_scan(region(), 1, "forward")
    assert_in_order(src, "cs_nx_0 = tl.load(cs_ptr + row_0 + s_nx, mask=s_nx < off", "if BK == BM:",
                    "dt_d_0 = tl.load(dtp_ptr + row_0 + t", "acc_0 = tl.dot(c_t",
                    "for k0 in range(0, off, BK):", "cs_s = cs_nx_0", "dt_s = dt_nx_0", "acc_0 = tl.dot(",
                    "s_nx = k0 + BK + tl.arange(0, BK)", "cs_nx_0 = tl.load(",
                    "if BK == BM:", "k0 = pid_m * BM", "cs_s = cs_t_0", "dt_s = dt_d_0", "acc_0 = tl.dot(",
                    "else:", "for k0 in range(off, pid_m * BM + BM, BK):", "cs_s = tl.load(")


def test_chunk_cb_writes_causal_tile_pairs_once_per_group():
    src = render_fwd.render_chunk_cb(region())
    assert_in_order(src, "def ssd_chunk_cb(b_ptr, c_ptr, cb_ptr", "if pid_k * BK < pid_m * BM + BM:",
                    "c_t = tl.load(c_ptr", "b_s = tl.load(b_ptr", "cb = tl.dot(c_t, tl.trans(b_s))", "else:",
                    "cb = tl.zeros((BM, BK)", "tl.store(cb_ptr + base")
    assert "cbt_ptr" not in src
    both = render_fwd.render_chunk_cb(region(), transposed=True)
    assert_in_order(both, "def ssd_chunk_cb_both(b_ptr, c_ptr, cb_ptr, cbt_ptr",
                    "tl.store(cb_ptr + base + t[:, None] * 64 + s[None, :], cb",
                    "tl.store(cbt_ptr + base + s[None, :] * 64 + t[:, None], cb")
    dx = render_bwd_tiles.render_dx(region(), 1)
    assert "cb_ptr + cb_base + s[:, None] * 64 + t[None, :]" in dx  # the transpose, along its rows
    assert_in_order(dx, "cb_base = ", "dend = ", "rr = tl.minimum(dend, 64) - 1", "tl.exp(cend - cs_r_0)",
                    "for k0 in range(dend, 64, BK):", "cbt = tl.load(cb_ptr", "mask=in_t",
                    "wj = cbt * tl.exp(cs_t - cs_r_0)[None, :]",
                    "acc_0 = acc_0 * tl.exp(cs_r_0 - cs_s_0)[:, None]",
                    "for k0 in range((pid_m * BM) // BK * BK, dend, BK):", "causal = ", "cbt = tl.load(cb_ptr")
    assert "c_ptr" not in dx.replace("cb_ptr", "")


def test_even_constexpr_reaches_every_bounds_mask_of_the_big_kernels():
    """chunk scan, dx, dcb, dC and dB take EVEN: their chunk, sequence, headdim and dstate masks are or-ed
    with it (all true when the launch knows no tile runs past a bound), no bare bound remains."""
    srcs = {"chunk_scan": render_fwd.render_chunk_scan(region(), 1, "forward"),
            "dx": render_bwd_tiles.render_dx(region(), 1), "dcb": render_bwd_pairs.render_dcb(region(), 1),
            "dc": render_bwd_tiles.render_dbc(region(), "c"), "db": render_bwd_tiles.render_dbc(region(), "b")}
    for name, src in srcs.items():
        assert "EVEN: tl.constexpr" in src, name
        for x in ("t", "s"):
            assert f"in_{x} = ({x} < 64) | EVEN" in src, (name, x)
            assert f"v_{x} = (in_{x} & (pos_{x} < L)) | EVEN" in src or f"v_{x} =" not in src, (name, x)
        assert "m_p = (offs_p < P) | EVEN" in src, name
        assert "< 64," not in src and "< 64)[" not in src, name
    fused = render_fused.render_fused_forward(region())
    assert "EVEN" not in fused and "v_t = (t < 64) & (pos_t < L)" in fused


def test_even_tiles_needs_every_bound_met():
    from mambac.codegen.render_common import even_tiles
    from mambac.codegen.ssd_launch import Dims
    base = dict(b=1, l=512, h=2, g=1, p=64, n=128, q=256)
    assert even_tiles(Dims(**base), 64, 32)
    for change, blocks in ((dict(l=500), (64,)), (dict(p=48), (64,)), (dict(n=96), (64,)),
                           (dict(q=96, l=96 * 4), (64,))):
        assert not even_tiles(Dims(**{**base, **change}), *blocks), change


def test_no_gate_code_without_z_and_no_skip_without_d():
    src = render_fwd.render_chunk_scan(region(has_z=False, d_mode="none"), 1, "forward")
    assert "zz" not in src and "sigmoid" not in src and "x_t" not in src
    with pytest.raises(ValueError, match="only for regions with z"):
        render_fwd.render_chunk_scan(region(has_z=False), 1, "gate_backward")


def test_dot_precision_follows_dtype():
    fp32 = render_fwd.render_chunk_scan(region(io_dtype="fp32"), 1)
    assert 'input_precision="ieee"' in fp32 and "tl.bfloat16" not in fp32
    bf16 = render_fwd.render_chunk_scan(region(), 1)
    assert "input_precision" not in bf16 and "_to_bf16" not in bf16
    interp = render_fwd.render_chunk_scan(region(dot_precision="upcast"), 1)
    assert_in_order(interp, "def _to_bf16(v):", "(c_t).to(tl.float32)", '_to_bf16(wj)')


def test_backward_sources_in_order():
    dt = render_bwd.render_dt_backward(region(), 8)
    assert_in_order(dt, "def ssd_dt_backward(", "j = tl.arange(0, 8)", "mh = hh < H",
                    "dcs = tl.load(es_ptr + at, mask=m2, other=0.0) - vv",
                    "for k in tl.static_range(KP):", "tl.cumsum(dcs, 0, reverse=True)",
                    "tl.store(da_ptr", "v = v + bias", "pre = _softplus(v)",
                    "(pre >= dt_min) & (pre <= dt_max)", "g * tl.sigmoid(v)",
                    "tl.store(ddt_ptr + pos[:, None] * H + hh[None, :]", "tl.store(dbias_ptr")
    assert "bias" not in render_bwd.render_dt_backward(region(has_dt_bias=False), 8)
    dc = render_bwd_tiles.render_dbc(region(), "c")
    assert_in_order(dc, "for hh in range(hbase, hbase + hps):", "tl.store(es_ptr", "if hs == 0:",
                    "for k0 in range(0, pid_m * BT + BT, BS):", "dcb = tl.load(dcb_ptr + cb_base + t[:, None]",
                    "acc = tl.dot(dcb.to(tl.bfloat16), b_p, acc)", "tl.store(out")
    db = render_bwd_tiles.render_dbc(region(), "b")
    assert_in_order(db, "tl.store(v_ptr", "if hs == 0:", "for k0 in range((pid_m * BT) // BS * BS, 64, BS):",
                    "dcb = tl.load(dcb_ptr + cb_base + t[None, :]", "acc = tl.dot(dcb.to(tl.bfloat16), c_p, acc)")
    assert "gm = " not in dc + db and "pair_ptr" not in dc + db
    pairs = render_bwd_pairs.render_dcb(region(), 2)
    head_steps = ("for h0 in range(hbase, hbase + hps, 2):", "(h0 + 0) * sxh", "tl.dot(dy_t, tl.trans(x_s))",
                  "wsum += wj", "m = wj * cb", "tl.store(mrow_ptr", "tl.sum(m, 1)", "tl.store(mcol_ptr",
                  "tl.sum(m, 0)", "(h0 + 1) * sxh")
    assert_in_order(pairs, "def ssd_dcb(", "if pid_k < pid_m:", "cb = tl.load(cb_ptr", *head_steps[:2],
                    "cs_r = tl.load(cs_ptr + row + pid_k * BT + BT - 1)", head_steps[2],
                    "tl.exp(cs_t - cs_r)[:, None]", *head_steps[3:], "elif pid_k == pid_m:", "causal = ",
                    "cb = tl.load(cb_ptr", *head_steps[:3], "tl.exp(tl.where(causal", *head_steps[3:],
                    "else:", "wsum = tl.zeros", "tl.store(dcb_ptr + hs.to(tl.int64) * DS")
    assert_in_order(db, "for sp in range(1, NS):", "dcb += tl.load(dcb_ptr + sp * DS")
    sp = render_bwd.render_state_pass_bwd(region())
    assert_in_order(sp, "for cc in range(0, NC):", "tl.store(dsout_ptr", "tl.store(dtot_ptr",
                    "ds = ds * dec", "tl.store(dinit_ptr")


def test_region_validation():
    with pytest.raises(ValueError, match="d_mode"):
        region(d_mode="diag")
    with pytest.raises(ValueError, match="io_dtype"):
        region(io_dtype="fp64")
    with pytest.raises(ValueError, match="dot_precision"):
        region(dot_precision="fast")
    assert region(chunk_size=100).chunk_pow2 == 128
    assert "softplus" in region().summary()


def test_descriptor_chunk_scan_source_in_order():
    """The ``tma`` chunk scan takes five descriptors and loads C, the state, C B^T and x through
    them (no pointer tiles for those in its loops); the rows' own x for the D skip is loaded
    before the loops, and y leaves through its descriptor."""
    src = render_fwd.render_chunk_scan(region(), 1, "forward", tma=True)
    assert_in_order(src, "xd, cd, sd, cbd, yd, BM: tl.constexpr", "seq0 = bi * L + pid_c * 64",
                    "c_t = cd.load([seq0 + pid_m * BM, g * N])", "x_t_0 = tl.load(x_ptr",
                    "st_0 = tl.trans(sd.load([((bi * NC + pid_c) * H + h0 + 0) * P, 0]))",
                    "for k0 in range(0, off, BK):", "cb = cbd.load([cb_row + pid_m * BM, k0])",
                    "x_s = xd.load([seq0 + k0, (h0 + 0) * P])",
                    "for k0 in range(off, pid_m * BM + BM, BK):", "causal = ", "cb = cbd.load(",
                    "# epilogue of head 0", "x_t = x_t_0.to(tl.float32)",
                    "yd.store([seq0 + pid_m * BM, (h0 + 0) * P], ")
    assert "cb_ptr + cb_base" not in src and "tl.load(c_ptr" not in src and "tl.store(y_ptr" not in src
    ast.parse(src)
    assert "cbd" not in render_fwd.render_chunk_scan(region(), 1, "forward")


def test_descriptor_backward_sources_in_order():
    """dx, dcb, dC and dB in their ``tma`` forms load their hot tiles through descriptors."""
    dx = render_bwd_tiles.render_dx(region(), 1, tma=True)
    assert_in_order(dx, "bd, dsd, cbd, dyd, BM: tl.constexpr", "b_s = bd.load([seq0 + pid_m * BM, g * N])",
                    "ds = tl.trans(dsd.load(", "for k0 in range(dend, 64, BK):",
                    "cbt = cbd.load([cb_row + pid_m * BM, k0])", "dy_t = dyd.load([seq0 + k0, (h0 + 0) * P])",
                    "# epilogue of head 0")
    dcb = render_bwd_pairs.render_dcb(region(), 2, tma=True)
    assert_in_order(dcb, "xd, dyd, cbd, BT: tl.constexpr", "if pid_k < pid_m:",
                    "cb = cbd.load([cb_row + pid_m * BT, pid_k * BT])",
                    "dy_t = dyd.load([seq0 + pid_m * BT, (h0 + 0) * P])",
                    "x_s = xd.load([seq0 + pid_k * BT, (h0 + 0) * P])", "elif pid_k == pid_m:")
    dc = render_bwd_tiles.render_dbc(region(), "c", tma=True)
    assert_in_order(dc, "ownd, hd, sd, otherd, dcbd, BT: tl.constexpr", "c_r = ownd.load(",
                    "dy_t = hd.load([seq0 + pid_m * BT, hh * P])", "st = sd.load(",
                    "b_p = otherd.load([seq0 + k0, g * N])", "dcb = dcbd.load([cb_row + pid_m * BT, k0])",
                    "for sp in range(1, NS):", "dcb += dcbd.load([sp * (DS // 64) + cb_row + pid_m * BT, k0])",
                    "tl.store(out")
    db = render_bwd_tiles.render_dbc(region(), "b", tma=True)
    assert_in_order(db, "b_r = ownd.load(", "x_s = hd.load(", "c_p = otherd.load(",
                    "dcb = dcbd.load([cb_row + k0, pid_m * BT])", "tl.trans(dcb)")
    for src in (dx, dcb, dc, db):
        ast.parse(src)


def test_state_walk_sources_in_order():
    """The forward walk over chunks C_LO .. C_HI (from the state the previous segment left when
    C_LO > 0): dt one block ahead, the state entering a chunk stored at its first block
    before the block is added, the block's decay on the state in the dot's accumulator, the final
    state after the loop; the reverse walk: the state gradient and the total-decay part stored at
    a chunk's last block, then the block's dy^T C added, the initial state's gradient after."""
    fwd = render_state_walk.render_state_walk(region())
    assert_in_order(fwd, "def ssd_state_walk(dt_ptr, a_ptr, bias_ptr, dt_min, dt_max, init_ptr, sin_ptr",
                    "acc = tl.load(init_ptr", "if C_LO > 0:", "acc = tl.load(final_at)", "d_next = tl.load(dt_ptr",
                    "for k in range(C_LO * 64, C_HI * 64, BT):",
                    "d_next = tl.load(dt_ptr", "tl.store(sin_ptr", "run = tl.where(k0 == 0, 0.0, run)",
                    "d = _dt_transform(d, bias, dt_min, dt_max)", "x_s = xd.load([seq0 + k, h * P + p0])",
                    "b_s = bd.load([seq0 + k, g * N + n0])", "xw = (x_s.to(tl.float32) * (d * tl.exp(end - cs))",
                    "acc = tl.dot(tl.trans(xw), b_s, acc * tl.exp(end - run)", "tl.store(final_at, acc)")
    assert "tl.zeros" not in fwd
    assert "acc = tl.zeros((BP, BN)" in render_state_walk.render_state_walk(region(has_initial_state=False))
    bwd = render_state_walk.render_state_walk_bwd(region())
    assert_in_order(bwd, "def ssd_state_walk_bwd(cs_ptr, sin_ptr, dfinal_ptr, dsout_ptr, dinit_ptr, dtot_ptr",
                    "acc = tl.load(dfinal_ptr", "for kk in range(0, NC * 64, BT):", "k = last - kk",
                    "cs_prev = tl.load(cs_ptr", "tl.store(dsout_ptr", "s_in = tl.load(sin_ptr",
                    "part = tl.exp(end) * tl.sum(tl.sum(s_in * acc, 1), 0)", "tl.store(dtot_ptr",
                    "dy_s = dyd.load([seq0 + k, h * P + p0])", "c_s = cd.load([seq0 + k, g * N + n0])",
                    "acc = tl.dot(tl.trans(dyw), c_s, acc * tl.exp(end - run)", "cs_cur = cs_prev",
                    "tl.store(dinit_ptr")
    for src in (fwd, bwd):
        ast.parse(src)


@pytest.mark.parametrize("tma", [False, True])
def test_fold_forms_add_the_fold_as_they_load_the_states(tma):
    """Context parallelism's fold forms: the chunk scan adds fw[b, h, c] * (C fs[b, h]) to the
    zero-start state's dot with C, as a second dot (the summed state is formed only by the first
    row tile, which stores it); dx and dB likewise add a second dot with the later ranks' part of
    each leaving-state gradient.  The plain kernels take no fold, and only those three have a fold
    form.  dC's part form adds, in its first row tile, the later ranks' part of each chunk's
    total-decay gradient from the state it loads."""
    r = region(has_initial_state=False)
    scan = render_fwd.render_chunk_scan(r, 1, "forward", tma, fold=True)
    fs = ("fs_0 = tl.trans(fsd.load([(bi * H + h0 + 0) * P, 0]))" if tma
          else "fs_0 = tl.load(fs_ptr + (bi64 * H + h0 + 0)")
    assert_in_order(scan, "def ssd_chunk_scan_fold(", "sin_ptr, fs_ptr, fw_ptr, so_ptr, C_LO",
                    *(["fsd, BM"] if tma else []),
                    "st_0 = ", "fw_0 = tl.load(fw_ptr + (bi64 * H + h0 + 0) * NC + pid_c)", fs, "if pid_m == 0:",
                    "tl.store(so_ptr + ((bi64 * NC + pid_c) * H + h0 + 0)",
                    "(st_0.to(tl.float32) + fw_0 * fs_0.to(tl.float32))",
                    "acc_0 = (tl.dot(c_t, st_0", "+ fw_0 * tl.dot(c_t, fs_0", ")) * tl.exp(cs_r_0)")
    assert scan.count("tl.dot(c_t,") == 2
    dx = render_bwd_tiles.render_dx(r, 1, tma, fold=True)
    assert_in_order(dx, "def ssd_dx_fold(", "dsout_ptr, fs_ptr, fw_ptr, ddtd_ptr", *(["fsd, BM"] if tma else []),
                    "ds = ", "fw = tl.load(fw_ptr + (bi64 * H + h0 + 0) * NC + pid_c)",
                    "fs = tl.trans(fsd.load([(bi * H + h0 + 0) * P, 0]))" if tma else "fs = tl.load(fs_ptr + (",
                    "acc_0 = (tl.dot(b_s, ds.to(", "+ fw * tl.dot(b_s, fs", ")) * tl.exp(cend - cs_r_0)")
    db = render_bwd_tiles.render_dbc(r, "b", tma, fold=True)
    assert_in_order(db, "def ssd_db_fold(", "dsout_ptr, fs_ptr, fw_ptr, dcb_ptr", *(["fsd, BT"] if tma else []),
                    "st = ", "fw = tl.load(fw_ptr + (bi64 * H + hh) * NC + pid_c)",
                    "fs = fsd.load([(bi * H + hh) * P, 0])" if tma else "fs = tl.load(fs_ptr + (",
                    "f = (tl.dot(x_s, st.to(", "+ fw * tl.dot(x_s, fs", ")) * (dt_r")
    for src in (dx, db):
        assert ".to(tl.float32) + fw" not in src   # the summed state is never formed
    dc = render_bwd_tiles.render_dbc(r, "c", tma, part=True)
    assert_in_order(dc, "def ssd_dc_part(", "sin_ptr, gs_ptr, gw_ptr, dtot_ptr, DTS, DT0, dcb_ptr",
                    "for hh in range(",
                    "gs = tl.load(gs_ptr + (bi64 * H + hh) * P * N + offs_p[:, None] * N + offs_n[None, :], "
                    "mask=m_p[:, None] & (m_n & (offs_n * 0 + pid_m == 0))[None, :]", "st = ", "e = ",
                    "if pid_m == 0:", "gw = tl.load(gw_ptr + (bi64 * H + hh) * NC + pid_c)",
                    "tot = tl.load(cs_ptr + row + 63)", "rows_in = tl.sum(st.to(tl.float32) * gs.to(tl.float32), 1)",
                    "tl.store(dtot_ptr + ((bi64 * H + hh) * NC + pid_c) * DTS + DT0 + offs_p, "
                    "tl.exp(tot) * gw * rows_in, mask=m_p)",
                    "out = out_ptr")
    for src in all_sources(r).values():
        assert "fs_ptr" not in src and "so_ptr" not in src and "gs_ptr" not in src
    with pytest.raises(ValueError, match="only the forward chunk scan"):
        render_fwd.render_chunk_scan(r, 1, "gate_backward", tma, fold=True)
    with pytest.raises(ValueError, match="only db"):
        render_bwd_tiles.render_dbc(r, "c", tma, fold=True)
    with pytest.raises(ValueError, match="only dc"):
        render_bwd_tiles.render_dbc(r, "b", tma, part=True)
