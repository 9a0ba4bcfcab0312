"""Generated causal-conv1d and RMSNorm kernels under the Triton interpreter, forward and backward,
against each op's reference run in float64 (exact there), at small awkward shapes.

Half-precision cases give the kernels inputs already rounded to bf16 and the referee the same
values in float64, so the comparison measures the kernels' own rounding.  Tolerances (relative,
in norm): fp32 1e-4, bf16 1e-2.
"""
from __future__ import annotations

import pytest
import torch

from mambac.codegen import conv_kernels, norm_kernels, render_conv, render_norm
from mambac.codegen.conv_norm_ir import AddNormRegion, ConvRegion, GatedNormRegion
from mambac.ops import add_rmsnorm as add_mod  # noqa: F401  (registers the ops)
from mambac.ops.add_rmsnorm import reference as add_ref
from mambac.ops.causal_conv1d import reference as conv_ref
from mambac.ops.gated_rmsnorm import reference as gated_ref
from tests.helpers import assert_in_order, rel_err

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _referee(fn, inputs, cotangents):
    """float64 outputs of ``fn`` and the gradients of every tensor input under ``cotangents``."""
    ref = [a.detach().double().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a
           for a in inputs]
    outs = fn(*ref)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * g.double()).sum() for o, g in zip(outs, cotangents) if g is not None)
    loss.backward()
    return outs, [a.grad if isinstance(a, torch.Tensor) else None for a in ref]


def _check(name, got, want, dtype):
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]}"


@pytest.mark.interp
@pytest.mark.parametrize("width,bias,init,act,dtype,channels_last", [
    (4, True, True, "silu", torch.float32, True),
    (3, False, False, "none", torch.float32, False),
    (4, True, False, "silu", torch.bfloat16, True),
    (2, False, True, "none", torch.bfloat16, False),
])
def test_causal_conv1d_kernels(width, bias, init, act, dtype, channels_last):
    gen = torch.Generator().manual_seed(width)
    b, d, l = 2, 19, 23  # channels and steps not multiples of the tile
    if channels_last:  # a transposed (b, L, d) tensor, as the mixers pass it
        x = torch.randn(b, l, d, generator=gen).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(b, d, l, generator=gen).to(dtype)
    w = torch.randn(d, width, generator=gen)
    bb = torch.randn(d, generator=gen) if bias else None
    ii = torch.randn(b, d, width - 1, generator=gen).to(dtype) if init else None
    gy = torch.randn(b, d, l, generator=gen).to(dtype)
    gf = torch.randn(b, d, width - 1, generator=gen).to(dtype)
    (y_ref, f_ref), grads_ref = _referee(lambda *a: conv_ref(*a, act), [x, w, bb, ii], [gy, gf])
    y, final = conv_kernels.conv_forward(x, w, bb, ii, act)
    assert y.dtype == dtype and final.dtype == dtype and final.shape == f_ref.shape
    _check("y", y, y_ref, dtype)
    _check("final_state", final, f_ref, dtype)
    assert y.stride() == x.stride()  # laid out as x: channels innermost stay innermost
    grads = conv_kernels.conv_backward(gy, gf, x, w, bb, ii, act)
    assert grads[0].stride() == x.stride()
    for name, g, r in zip(("dx", "dweight", "dbias", "dinit"), grads, grads_ref):
        assert (g is None) == (r is None), name
        if r is not None:
            _check(name, g, r, dtype)


@pytest.mark.interp
def test_kernels_on_slices_with_8_aligned_rows():
    """The mixers' layout: conv input and gate are slices of one projection output whose row stride
    (40 here, 3352 in the 130M model) is a multiple of 8 but not of 16.  The regions record the
    alignment (so the GPU loads stay vectorised), the source marks those offsets, and the results
    still match the float64 referee."""
    gen = torch.Generator().manual_seed(11)
    b, l, d = 2, 21, 24
    proj = torch.randn(b, l, 40, generator=gen)
    x = proj[..., 8:32].transpose(1, 2)  # (b, d, l) view, channels innermost, time stride 40
    w, bb = torch.randn(d, 4, generator=gen), torch.randn(d, generator=gen)
    gy, gf = torch.randn(b, d, l, generator=gen), torch.randn(b, d, 3, generator=gen)
    region = conv_kernels.region_of(w, bb, None, "silu", x=x, o=x)
    hints = dict(region.hints)
    assert hints["sxl"] == 8 and hints["sol"] == 8 and "sxd" not in hints and "align=[" in region.summary()
    src = render_conv.render_backward(region)
    assert "tl.multiple_of(((offs_m + 0 - 3) * sxl), 8)" in src and "tl.multiple_of(((q) * sgl)" not in src
    (y_ref, _), grads_ref = _referee(lambda *a: conv_ref(*a, "silu"), [x, w, bb, None], [gy, gf])
    y, _ = conv_kernels.conv_forward(x, w, bb, None, "silu")
    _check("y", y, y_ref, torch.float32)
    for name, g, r in zip(("dx", "dweight", "dbias"), conv_kernels.conv_backward(gy, gf, x, w, bb, None, "silu"),
                          grads_ref):
        _check(name, g, r, torch.float32)
    z = proj[..., 8:32]  # (b, l, 24) rows of stride 40
    xn, wn, gn = torch.randn(b, l, d, generator=gen), torch.randn(d, generator=gen), torch.randn(b, l, d, generator=gen)
    assert dict(norm_kernels.gated_region(z, 12, False, szm=40, N=24).hints) == {"szm": 8, "N": 8}
    assert "ro_szm = tl.multiple_of(((rows) * szm), 8)" in render_norm.render_gated_backward(
        norm_kernels.gated_region(z, 12, False, szm=40))
    (yn_ref,), (dx_r, dw_r, dz_r) = _referee(lambda a, c, e: gated_ref(a, c, e, 1e-5, 12, False), [xn, wn, z], [gn])
    _check("norm y", norm_kernels.gated_forward(xn, wn, z, 1e-5, 12, False), yn_ref, torch.float32)
    for name, g, r in zip(("dx", "dweight", "dz"), norm_kernels.gated_backward(gn, xn, wn, z, 1e-5, 12, False),
                          (dx_r, dw_r, dz_r)):
        _check("norm " + name, g, r, torch.float32)


@pytest.mark.interp
@pytest.mark.parametrize("gate,group,dtype", [
    ("before", 6, torch.float32), ("after", 18, torch.float32), ("none", 18, torch.bfloat16),
    ("before", 9, torch.bfloat16),
])
def test_gated_rmsnorm_kernels(gate, group, dtype):
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(3, 5, 18, generator=gen).to(dtype)
    w = torch.randn(18, generator=gen)
    z = None if gate == "none" else torch.randn(3, 5, 18, generator=gen).to(dtype)
    nbg = gate == "after"
    gy = torch.randn(3, 5, 18, generator=gen).to(dtype)
    (y_ref,), (dx_r, dw_r, dz_r) = _referee(lambda a, b, c: gated_ref(a, b, c, 1e-5, group, nbg), [x, w, z], [gy])
    y = norm_kernels.gated_forward(x, w, z, 1e-5, group, nbg)
    assert y.dtype == dtype
    _check("y", y, y_ref, dtype)
    dx, dw, dz = norm_kernels.gated_backward(gy, x, w, z, 1e-5, group, nbg)
    _check("dx", dx, dx_r, dtype)
    _check("dweight", dw, dw_r, dtype)
    if z is not None:
        _check("dz", dz, dz_r, dtype)


@pytest.mark.interp
@pytest.mark.parametrize("residual,fp32_res,dtype,wdtype", [
    (True, False, torch.float32, torch.float32), (False, False, torch.float32, torch.float32),
    (True, True, torch.bfloat16, torch.float32), (True, True, torch.bfloat16, torch.bfloat16),
    (False, True, torch.float32, torch.bfloat16),
])
def test_add_rmsnorm_kernels(residual, fp32_res, dtype, wdtype):
    """``out`` in the weight's dtype, ``residual_out`` in x's (fp32 with ``residual_in_fp32``); the
    last case is a bf16 block's norm of its fp32 residual sum."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 33, generator=gen).to(dtype)
    r = torch.randn(7, 33, generator=gen).to(dtype) if residual else None
    w = torch.randn(33, generator=gen).to(wdtype)
    res_dtype = torch.float32 if fp32_res else dtype
    go = torch.randn(7, 33, generator=gen).to(wdtype)
    gr = torch.randn(7, 33, generator=gen).to(res_dtype)
    (o_ref, r_ref), grads_ref = _referee(lambda a, b, c: add_ref(a, b, c, 1e-5, fp32_res), [x, r, w], [go, gr])
    out, res_out = norm_kernels.add_forward(x, r, w, 1e-5, fp32_res)
    assert out.dtype == wdtype and res_out.dtype == res_dtype
    tol = torch.bfloat16 if torch.bfloat16 in (dtype, wdtype) else dtype
    _check("out", out, o_ref, tol)
    _check("residual_out", res_out, r_ref, tol)
    for name, g, ref in zip(("dx", "dresidual", "dweight"), norm_kernels.add_backward(go, gr, x, r, w, 1e-5),
                            grads_ref):
        assert (g is None) == (ref is None), name
        if ref is not None:
            _check(name, g, ref, tol)
    # only the residual stream's gradient (the normalised output unused)
    dx, _, dw = norm_kernels.add_backward(None, gr, x, r, w, 1e-5)
    _check("dx (no dout)", dx, gr.double(), tol)
    assert dw.abs().max() == 0


def test_conv_source_is_specialised_to_the_flags():
    src = render_conv.render_forward(ConvRegion(width=4, has_bias=True, silu=True, has_initial_state=True))
    assert_in_order(src, "def causal_conv1d_fwd(x_ptr, w_ptr, bias_ptr, init_ptr, y_ptr, final_ptr",
                    "w_3 = tl.load", "acc = tl.zeros", "bias_ptr + offs_d", "acc += w_0", "ib[:, None]",
                    "acc += w_3", "acc = acc * tl.sigmoid(acc)", "tl.store(y_ptr", "if pid_l == 0:",
                    "tl.store(final_ptr")
    plain = render_conv.render_forward(ConvRegion(width=3, has_bias=False, silu=False, has_initial_state=False))
    assert "sigmoid" not in plain and "bias_ptr" not in plain and "ib[" not in plain and "w_3" not in plain
    bwd = render_conv.render_backward(ConvRegion(width=4, has_bias=True, silu=True, has_initial_state=True,
                                                 has_dfinal=True))
    assert_in_order(bwd, "def causal_conv1d_bwd(", "f_0 = ", "f_6 = ", "g_0 = tl.load", "u = ",
                    "g_0 = g_0 * sg", "g_3 = ", "dfull = w_0[:, None] * g_0", "dfinal_ptr", "tl.store(dx_ptr",
                    "tl.store(dinit_ptr", "tl.store(dw_ptr", "tl.store(db_ptr")
    compile(bwd, "bwd", "exec")


def test_norm_sources_are_specialised_to_the_flags():
    before = render_norm.render_gated_forward(GatedNormRegion(has_z=True, norm_before_gate=False, group_pow2=64))
    assert_in_order(before, "def gated_rmsnorm_fwd(x_ptr, w_ptr, z_ptr, y_ptr", "tl.arange(0, 64)",
                    "sz = zz * sg", "h = xv * sz", "rstd = ", "out = n * wv[None, :]\n", "tl.store(y_ptr")
    after = render_norm.render_gated_forward(GatedNormRegion(has_z=True, norm_before_gate=True, group_pow2=64))
    assert_in_order(after, "h = xv\n", "rstd = ", "out = n * wv[None, :] * sz")
    nogate = render_norm.render_gated_backward(GatedNormRegion(has_z=False, norm_before_gate=False, group_pow2=32))
    assert "z_ptr" not in nogate and "dz_ptr" not in nogate
    assert_in_order(nogate, "g = tl.load(dy_ptr", "tl.store(dw_ptr", "dh = rstd", "tl.store(dx_ptr")
    add = render_norm.render_add_backward(AddNormRegion(has_residual=True, width_pow2=1024, has_dout=True,
                                                        has_dres=True))
    assert_in_order(add, "def add_rmsnorm_bwd(x_ptr, res_ptr, w_ptr, dout_ptr, dres_ptr, dx_ptr, dresid_ptr",
                    "h = tl.load(x_ptr", "+ tl.load(res_ptr", "tl.store(dw_ptr", "dh = dh + tl.load(dres_ptr",
                    "tl.store(dx_ptr", "tl.store(dresid_ptr")
    fwd = render_norm.render_add_forward(AddNormRegion(has_residual=False, width_pow2=16))
    assert "res_ptr" not in fwd.replace("resout_ptr", "") and "tl.arange(0, 16)" in fwd
