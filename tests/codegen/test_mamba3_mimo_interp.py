"""Generated Mamba-3 MIMO kernels, forward and backward, under the Triton interpreter against a
float64 step-by-step referee; the generated source; the op wiring.

Ranks 2 and 3 (unrolled in the source), odd head counts, headdim not a power of two, lengths not
a multiple of the chunk, with and without the output fold (mimo_o) and the per-rank gate.
Tolerances: fp32 1e-4, bf16 1e-2 (relative, in norm).
"""
from __future__ import annotations

import pytest
import torch

from mambac.codegen import render_mamba3_mimo as R
from mambac.codegen.mamba3_mimo_kernels import mamba3_mimo_backward, mamba3_mimo_forward, supports
from mambac.codegen.scan_ir import Mamba3MimoRegion
from tests.codegen.scan_cases import assert_grads_match, check_mamba3, count_calls, mamba3_inputs
from tests.codegen.scan_referee import mamba3_mimo_referee
from tests.helpers import rel_err

NAMES = ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias", "mimo_x", "mimo_z", "mimo_o", "D",
         "z", "initial_angle", "initial_ssm", "initial_k", "initial_v")


def make_inputs(seed, b, l, h, p, n, g, s, r, **flags):
    return mamba3_inputs(NAMES, seed, b, l, h, p, n, g, s, r, **flags)


def check(args, chunk, seed=0):
    check_mamba3(NAMES, args, mamba3_mimo_referee, mamba3_mimo_forward, mamba3_mimo_backward, 16, chunk, seed)


@pytest.mark.interp
@pytest.mark.parametrize("case", [
    # (b, l, h, p, n, g, s, r), flags, chunk
    dict(shape=(1, 7, 3, 3, 6, 1, 2, 2), flags=dict(bias=True, z=True, fold=True, D=True, init=True), chunk=4),
    dict(shape=(1, 5, 4, 2, 6, 2, 3, 3), flags=dict(D=True, bias=True, fold=True), chunk=4),
    dict(shape=(2, 5, 1, 3, 4, 1, 2, 2), flags=dict(z=True, init=True), chunk=4),
], ids=["all-r2-h3-L7", "groups2-r3-L5", "per-rank-out-L5"])
def test_fp32_matches_referee(case):
    check(make_inputs(len(str(case)), *case["shape"], **case["flags"]), case["chunk"])


@pytest.mark.interp
def test_bf16_matches_referee():
    check(make_inputs(6, 1, 5, 2, 4, 4, 2, 2, 2, bias=True, z=True, fold=True, D=True, init=True,
                      dtype=torch.bfloat16), 4)


@pytest.mark.interp
def test_op_runs_generated_kernels_in_triton_mode(monkeypatch):
    """mambac.ops.mamba3_mimo in mode 'triton' runs the generated forward and backward; the
    results match the op's own reference."""
    import mambac.codegen.mamba3_mimo_kernels as K
    from mambac.ops import mamba3_mimo, use_kernels
    from mambac.ops.mamba3_mimo import reference

    calls = count_calls(monkeypatch, K, ("mamba3_mimo_forward", "mamba3_mimo_backward"), chunk=4)
    args = make_inputs(3, 1, 5, 1, 3, 4, 1, 2, 2, fold=True, D=True)
    leaves = [None if a is None else a.clone().requires_grad_(True) for a in args]
    with use_kernels("triton"):
        y, st = mamba3_mimo(*leaves[:7], mimo_x=leaves[9], mimo_o=leaves[11], D=leaves[12], chunk_size=4,
                            return_final_state=True)
        (y.square().sum() + st.ssm.sum()).backward()
    assert calls == ["mamba3_mimo_forward", "mamba3_mimo_backward"]
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    y_ref, *st_ref = reference(*ref_in, 4)
    (y_ref.square().sum() + st_ref[1].sum()).backward()
    assert rel_err(y, y_ref) < 1e-5 and rel_err(st.ssm, st_ref[1]) < 1e-5
    assert_grads_match(NAMES, leaves, ref_in)


def test_supports_needs_even_dstate_and_no_float64():
    args = make_inputs(1, 1, 2, 1, 2, 4, 1, 1, 2)
    assert supports(*args, 4)
    assert not supports(*[None if a is None else a.double() for a in args], 4)
    odd = list(args)
    odd[1] = odd[1][..., :3]
    assert not supports(*odd, 4)


def _region(**kw) -> Mamba3MimoRegion:
    return Mamba3MimoRegion(io_dtype="bf16", chunk=16, round_bf16=False, **kw)


def test_source_unrolls_the_rank_and_follows_the_flags():
    src = R.render_forward(_region(rank=3, has_z=True, has_mimo_o=True, has_D=True))
    order = ["def mamba3_mimo_fwd(", "ux0 = tl.load", "uz0 = tl.load", "uo0 = tl.load", "ux2 = tl.load",
             "for c in range(0, NC)", "theta = theta + PI * tang * dtv", "ke0 = bbe * cs - bbo * sn",
             "ke2 = bbe * cs - bbo * sn", "Se = alpha[None, :] * Se", "(ux2 * xv)[:, None] * (gamma * ke2)",
             "a = uz0 * zv", "y += uo0 * o", "y += uo2 * o", "tl.store(y_ptr + sidx * P + offs_p"]
    pos = [src.index(s) for s in order]
    assert pos == sorted(pos), order
    assert "ke3" not in src and "Bb_ptr" not in src and "ia_ptr" not in src
    per_rank = R.render_forward(_region(rank=2))
    assert "* 2 + 1) * H + hi) * P + offs_p" in per_rank and "uo_ptr" not in per_rank and "Dv" not in per_rank
    bwd = R.render_backward(_region(rank=2, has_mimo_o=True))
    order = ["def mamba3_mimo_bwd(", "for cc in range(0, NC)", "for ii in range(0, T)", "go = uo0 * gyv",
             "duo0 += gyv * o", "go = uo1 * gyv", "dalpha = ", "dux0 += ", "pke0 = tl.where(tv, beta",
             "dux1 += ", "Ge = alpha[None, :] * Ge", "tl.store(dux_ptr", "tl.store(duo_ptr"]
    pos = [bwd.index(s) for s in order]
    assert pos == sorted(pos), order


def test_dump_sources_follow_the_call():
    from mambac.codegen.scan_dump import mamba3_mimo_sources
    args = make_inputs(2, 1, 3, 2, 4, 4, 1, 1, 3, fold=True) + [16]
    srcs = mamba3_mimo_sources(args)
    assert [name for name, _, _ in srcs] == ["mamba3_mimo_fwd", "mamba3_mimo_fwd", "mamba3_mimo_bwd"]
    assert "rank=3" in srcs[0][1] and "mimo_o" in srcs[0][1] and "ke2 = " in srcs[0][2]
    assert "tl.store(cS_ptr" in srcs[1][2] and "y_ptr" not in srcs[1][2]
