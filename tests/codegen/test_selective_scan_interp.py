"""Generated Mamba-1 selective-scan kernels, forward and backward, under the Triton interpreter
against a float64 step-by-step referee; the generated source; the op wiring.

Half-precision cases round u, delta, B, C, z (and the output cotangent) to bf16 first, so the
comparison measures the kernels' own rounding.  Tolerances: fp32 1e-4, bf16 1e-2 (relative, in
norm).  Lengths are not multiples of the chunk, channel counts are odd.
"""
from __future__ import annotations

import pytest
import torch

from mambac.codegen import render_selective_scan as R
from mambac.codegen.scan_ir import SelectiveScanRegion
from mambac.codegen.selective_scan_kernels import (selective_scan_backward, selective_scan_forward,
                                                   supports)
from tests.codegen.scan_cases import assert_grads_match, count_calls
from tests.codegen.scan_referee import selective_scan_referee
from tests.codegen.referee import check_grads
from tests.helpers import rel_err

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state")
HALF = ("u", "delta", "B", "C", "z")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def make_inputs(seed, b, d, l, n, g, *, D=False, z=False, bias=False, init=False, dtype=torch.float32):
    """g = 0: B and C shared by all channels (batch, dstate, seqlen); else grouped."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    bc = (b, n, l) if g == 0 else (b, g, n, l)
    vals = {"u": r(b, d, l), "delta": r(b, d, l) * 0.5 - 1.0, "A": -torch.rand(d, n, generator=gen) - 0.3,
            "B": r(*bc), "C": r(*bc), "D": r(d) if D else None, "z": r(b, d, l) if z else None,
            "delta_bias": r(d) * 0.3 if bias else None, "initial_state": r(b, d, n) if init else None}
    return [vals[k].to(dtype) if k in HALF and vals[k] is not None else vals[k] for k in NAMES]


def check(args, softplus, chunk, seed=0):
    dtype = args[0].dtype
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    o_ref, h_ref = selective_scan_referee(*ref_in, softplus)
    gen = torch.Generator().manual_seed(seed + 1)
    go = torch.randn(o_ref.shape, generator=gen).to(dtype)
    gh = torch.randn(h_ref.shape, generator=gen)
    ((o_ref * go.double()).sum() + (h_ref * gh.double()).sum()).backward()
    out, last = selective_scan_forward(*args, softplus, chunk=chunk)
    assert out.dtype == dtype and last.dtype == torch.float32
    errs = {"out": rel_err(out, o_ref), "last_state": rel_err(last, h_ref)}
    grads = selective_scan_backward(list(args) + [softplus], (go, gh), chunk=chunk)
    assert grads[-1] is None
    check_grads(errs, NAMES, grads, args, ref_in, TOL[dtype])


@pytest.mark.interp
@pytest.mark.parametrize("case", [
    # (b, d, l, n, g), flags, softplus, chunk
    dict(shape=(2, 3, 7, 4, 0), flags={}, softplus=False, chunk=4),
    dict(shape=(1, 6, 10, 5, 3), flags=dict(D=True, z=True, bias=True, init=True), softplus=True, chunk=4),
    dict(shape=(1, 5, 9, 3, 0), flags=dict(bias=True), softplus=False, chunk=8),
], ids=["plain-shared-BC-L7", "all-grouped3-L10", "bias-no-softplus-L9"])
def test_fp32_matches_referee(case):
    b, d, l, n, g = case["shape"]
    check(make_inputs(len(str(case)), b, d, l, n, g, **case["flags"]), case["softplus"], case["chunk"])


@pytest.mark.interp
def test_bf16_matches_referee():
    check(make_inputs(4, 1, 4, 9, 4, 2, D=True, z=True, bias=True, init=True, dtype=torch.bfloat16), True, 4)


@pytest.mark.interp
def test_op_runs_generated_kernels_in_triton_mode(monkeypatch):
    """mambac.ops.selective_scan in mode 'triton' runs the generated forward and backward (CPU
    tensors under the interpreter); the results match the op's reference."""
    import mambac.codegen.selective_scan_kernels as K
    from mambac.ops import selective_scan, use_kernels
    from mambac.ops.selective_scan import reference

    calls = count_calls(monkeypatch, K, ("selective_scan_forward", "selective_scan_backward"), chunk=4)
    args = make_inputs(9, 1, 3, 6, 4, 0, D=True, z=True, init=True)
    leaves = [None if a is None else a.clone().requires_grad_(True) for a in args]
    with use_kernels("triton"):
        out, last = selective_scan(*leaves[:5], D=leaves[5], z=leaves[6], delta_softplus=True,
                                   initial_state=leaves[8], return_last_state=True)
        (out.square().sum() + last.sum()).backward()
    assert calls == ["selective_scan_forward", "selective_scan_backward"]
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    o_ref, l_ref = reference(*ref_in, True)
    (o_ref.square().sum() + l_ref.sum()).backward()
    assert rel_err(out, o_ref) < 1e-5 and rel_err(last, l_ref) < 1e-5
    assert_grads_match(NAMES, leaves, ref_in)


@pytest.mark.interp
def test_backward_in_chunk_waves_matches_one_launch(monkeypatch):
    """A scratch budget below the whole sequence runs the backward's chunks in several launches."""
    import mambac.codegen.selective_scan_kernels as K
    args = list(make_inputs(7, 1, 2, 9, 3, 0, D=True)) + [True]
    grads = (torch.randn(1, 2, 9), torch.randn(1, 2, 3))
    whole = selective_scan_backward(args, grads, chunk=4)
    monkeypatch.setattr(K, "SCRATCH_BYTES", 4 * 2 * 4 * 3)  # one chunk of states per launch
    waves = selective_scan_backward(args, grads, chunk=4)
    for a, b in zip(whole, waves):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_supports_rejects_float64():
    args = make_inputs(1, 1, 2, 3, 2, 0)
    assert supports(*args, None, None, None, None, False)
    assert not supports(*[a.double() for a in args[:5]], None, None, None, None, False)


def _region(**kw) -> SelectiveScanRegion:
    return SelectiveScanRegion(io_dtype="bf16", chunk=64, round_bf16=False, **kw)


def test_sources_are_specialised_to_the_flags():
    r = _region(has_delta_bias=True, delta_softplus=True, has_D=True, has_z=True, has_init=True)
    out = R.render_chunk_out(r)
    order = ["def _softplus", "def selective_scan_chunk_out(", "bias_ptr", "c = tl.program_id(2)",
             "tl.load(ckpt_ptr", "for i in range(0, T)", "dv = dv + bias", "_softplus(dv)",
             "dA = tl.exp(dl[:, None] * A)", "h = dA * h", "y = y + Dv * u", "y = y * silu", "tl.store(out_ptr"]
    pos = [out.index(s) for s in order]
    assert pos == sorted(pos), order
    plain = R.render_chunk_out(_region())
    for absent in ("softplus", "bias", "Dv", "silu"):
        assert absent not in plain, absent
    local = R.render_chunk_local(_region(delta_softplus=True))
    assert local.index("h = tl.zeros((BD, NP)") < local.index("sdl += dl") < local.index("tl.store(local_ptr")
    combine = R.render_combine(r)
    order = ["tl.load(init_ptr", "for c in range(0, NC)", "tl.store(ckpt_ptr", "tl.exp(A * sdl[:, None]) * h",
             "tl.store(last_ptr"]
    pos = [combine.index(s) for s in order]
    assert pos == sorted(pos), order
    assert "_softplus" not in combine and "init_ptr" not in R.render_combine(_region())


def test_backward_sources_run_the_adjoint_per_chunk():
    r = _region(has_D=True, has_z=True, delta_softplus=True, has_init=True)
    adj = R.render_adjoint_local(r)
    assert adj.index("t = c * T + T - 1 - ii") < adj.index("gy = go * silu") < adj.index(
        "g = (g + gy[:, None] * Ct[None, :]) * dA") < adj.index("tl.store(gl_ptr")
    comb = R.render_adjoint_combine(r)
    assert comb.index("c = NC - 1 - cc") < comb.index("tl.store(gend_ptr") < comb.index("tl.store(dinit_ptr")
    src = R.render_backward(r)
    order = ["def selective_scan_bwd(", "c = C0 + c", "tl.load(ckpt_ptr", "g = tl.load(gend_ptr",
             "tl.store(scr + i * N, h",
             "i = T - 1 - ii", "hp = tl.load(scr", "tl.store(dz_ptr", "dD_acc += gy * u", 
             "g = g + gy[:, None] * Ct", "tl.atomic_add(dB_ptr", "g = g * dA", "ddl = ddl * tl.sigmoid(dv)",
             "tl.store(dA_ptr", "tl.store(dD_ptr"]
    pos = [src.index(s) for s in order]
    assert pos == sorted(pos), order
    assert "dinit_ptr" not in src and "dz_ptr" not in R.render_backward(_region())
