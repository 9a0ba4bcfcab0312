"""Generated Mamba-3 SISO kernels, forward and backward, under the Triton interpreter against a
float64 step-by-step referee; the generated source; the op wiring.

Odd dstate (a lone last state column), odd head counts, lengths not a multiple of the chunk,
heads sharing B/C groups.  Tolerances: fp32 1e-4, bf16 1e-2 (relative, in norm).
"""
from __future__ import annotations

import pytest
import torch

from mambac.codegen import render_mamba3 as R
from mambac.codegen.mamba3_kernels import mamba3_siso_backward, mamba3_siso_forward, supports
from mambac.codegen.scan_ir import Mamba3SisoRegion
from tests.codegen.scan_cases import assert_grads_match, check_mamba3, count_calls, mamba3_inputs
from tests.codegen.scan_referee import mamba3_siso_referee
from tests.helpers import rel_err

NAMES = ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias", "D", "z", "initial_angle",
         "initial_ssm", "initial_k", "initial_v")


def make_inputs(seed, b, l, h, p, n, g, s, **flags):
    return mamba3_inputs(NAMES, seed, b, l, h, p, n, g, s, **flags)


def check(args, chunk, seed=0):
    check_mamba3(NAMES, args, mamba3_siso_referee, mamba3_siso_forward, mamba3_siso_backward, 64, chunk, seed)


@pytest.mark.interp
@pytest.mark.parametrize("case", [
    # (b, l, h, p, n, g, s), flags, chunk
    dict(shape=(2, 6, 1, 4, 4, 1, 1), flags={}, chunk=4),
    dict(shape=(1, 7, 3, 3, 5, 1, 2), flags=dict(bias=True, D=True, z=True, init=True), chunk=4),
    dict(shape=(1, 5, 4, 2, 6, 2, 3), flags=dict(D=True, bias=True), chunk=4),
], ids=["plain-L6", "all-h3-n5-L7", "groups2-L5"])
def test_fp32_matches_referee(case):
    b, l, h, p, n, g, s = case["shape"]
    check(make_inputs(len(str(case)), b, l, h, p, n, g, s, **case["flags"]), case["chunk"])


@pytest.mark.interp
def test_bf16_matches_referee():
    check(make_inputs(6, 1, 7, 2, 4, 6, 1, 2, bias=True, D=True, z=True, init=True, dtype=torch.bfloat16), 4)


@pytest.mark.interp
def test_op_runs_generated_kernels_in_triton_mode(monkeypatch):
    """mambac.ops.mamba3_siso in mode 'triton' runs the generated forward and backward; the
    results match the op's own reference, and a sequence split in two equals it whole."""
    import mambac.codegen.mamba3_kernels as K
    from mambac.ops import mamba3_siso, use_kernels
    from mambac.ops.mamba3_siso import reference

    calls = count_calls(monkeypatch, K, ("mamba3_siso_forward", "mamba3_siso_backward"), chunk=4)
    args = make_inputs(3, 1, 5, 1, 3, 4, 1, 2, D=True, z=True)
    leaves = [None if a is None else a.clone().requires_grad_(True) for a in args]
    kw = dict(B_bias=None, C_bias=None, D=leaves[9], z=leaves[10], chunk_size=4)
    with use_kernels("triton"):
        y, st = mamba3_siso(*leaves[:7], **kw, return_final_state=True)
        (y.square().sum() + st.ssm.sum()).backward()
        y1, st1 = mamba3_siso(*[a[:, :3] for a in leaves[:7]], D=leaves[9], z=leaves[10][:, :3],
                              chunk_size=4, return_final_state=True)
        y2 = mamba3_siso(*[a[:, 3:] for a in leaves[:7]], D=leaves[9], z=leaves[10][:, 3:], chunk_size=4,
                         initial_state=st1)
    assert calls[:2] == ["mamba3_siso_forward", "mamba3_siso_backward"]
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    y_ref, *st_ref = reference(*ref_in, 4)
    (y_ref.square().sum() + st_ref[1].sum()).backward()
    assert rel_err(y, y_ref) < 1e-5 and rel_err(st.ssm, st_ref[1]) < 1e-5
    assert rel_err(torch.cat([y1, y2], 1), y_ref) < 1e-5
    assert_grads_match(NAMES, leaves, ref_in)


def test_supports_rejects_float64():
    args = make_inputs(1, 1, 2, 1, 2, 2, 1, 1)
    assert supports(*args, 4)
    assert not supports(*[None if a is None else a.double() for a in args], 4)


def _region(**kw) -> Mamba3SisoRegion:
    return Mamba3SisoRegion(io_dtype="bf16", chunk=32, round_bf16=False, **kw)


def test_forward_source_is_specialised_to_the_flags():
    full = R.render_forward(_region(has_B_bias=True, has_C_bias=True, has_D=True, has_z=True, init_angle=True,
                                    init_ssm=True, init_k=True, init_v=True))
    order = ["def _tanh", "def mamba3_siso_fwd(", "Bb_ptr", "ia_ptr", "Bbe = tl.load", "tl.load(is_ptr",
             "for c in range(0, NC)", "for i in range(0, T)", "theta = theta + PI * tang * dtv",
             "tl.floor(theta / TWO_PI)", "ke = bbe * cs - bbo * sn", "ko = bbe * sn + bbo * cs",
             "Se = alpha[None, :] * Se", "y = y + Dv * xv", "y = y * silu", "tl.store(y_ptr",
             "tl.store(fk_ptr", "xp = xv", "tl.store(fs_ptr", "tl.store(fa_ptr", "tl.store(fv_ptr"]
    pos = [full.index(s) for s in order]
    assert pos == sorted(pos), order
    plain = R.render_forward(_region())
    for absent in ("Bb_ptr", "Cb_ptr", "ia_ptr", "is_ptr", "Dv", "silu", "cS_ptr"):
        assert absent not in plain, absent


def test_backward_source_runs_the_adjoint_in_reverse():
    src = R.render_backward(_region(has_D=True, has_z=True))
    order = ["def mamba3_siso_bwd(", "for cc in range(0, NC)", "c = NC - 1 - cc", "tl.load(cS_ptr",
             "tl.store(sc + pp2, Se)", "for ii in range(0, T)", "i = T - 1 - ii", "Spe = tl.load(sc + pp2)",
             "tl.store(dz_ptr", "dD_acc += gyp * xv", "Ge = Ge + gyp[:, None] * qe[None, :]",
             "pke = tl.where(tv, beta", "Ge = alpha[None, :] * Ge", "gth += ", "tl.store(dBh_ptr",
             "tl.store(dang_ptr", "tl.store(dadt_ptr", "tl.store(dis_ptr", "tl.store(dia_ptr", "tl.store(dD_ptr"]
    pos = [src.index(s) for s in order]
    assert pos == sorted(pos), order
