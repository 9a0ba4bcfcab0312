import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mambac.errors import MambacInputError
from mambac.ops import Mamba3State, mamba3_mimo, mamba3_siso
from mambac.ops.mamba3_mimo import INFO as MIMO_INFO
from mambac.ops.mamba3_siso import INFO as SISO_INFO
from tests.helpers import compare_fwd_bwd


# ---------------------------------------------------------------------------------------------
# referees: one time step at a time, straight from the recurrence, rotations as complex products
# ---------------------------------------------------------------------------------------------

def turn(t, theta, halves):
    """Rotate feature pairs of t by theta: adjacent (2i, 2i+1) or halves (i, i + n/2), i < s."""
    s, n = theta.shape[-1], t.shape[-1]
    idx_a = torch.arange(s) * 2 if not halves else torch.arange(s)
    idx_b = idx_a + (1 if not halves else n // 2)
    w = torch.complex(t[..., idx_a], t[..., idx_b]) * torch.exp(1j * theta.to(torch.complex128))
    out = t.clone()
    out[..., idx_a] = w.real
    out[..., idx_b] = w.imag
    return out


def referee(x, B, C, dt, adt, trap, angles, Bb, Cb, mx, mz, mo, D, z, a0, s0, k0, v0, halves):
    """Rank-r Mamba-3 (SISO is r = 1 with unit mimo_x/mimo_o).  B, C (b, l, r, g, n)."""
    b, L, H, P = x.shape
    R, G, N = B.shape[2:]
    head_group = torch.arange(H) // (H // G)
    theta = torch.zeros(b, H, angles.shape[-1], dtype=x.dtype) if a0 is None else a0
    S = torch.zeros(b, H, P, N, dtype=x.dtype) if s0 is None else s0
    k_prev = torch.zeros(b, R, H, N, dtype=x.dtype) if k0 is None else k0
    x_prev = torch.zeros(b, H, P, dtype=x.dtype) if v0 is None else v0
    up = mx.transpose(0, 1)                                              # (r, h, p)
    ys = []
    for t in range(L):
        theta = torch.remainder(theta + math.pi * torch.tanh(angles[:, t]) * dt[:, t, :, None], 2 * math.pi)
        k = B[:, t][:, :, head_group] + (0 if Bb is None else Bb.transpose(0, 1))
        q = C[:, t][:, :, head_group] + (0 if Cb is None else Cb.transpose(0, 1))
        k, q = turn(k, theta[:, None], halves), turn(q, theta[:, None], halves)
        lam = 1 / (1 + torch.exp(-trap[:, t]))
        a = torch.exp(adt[:, t])
        v, v_prev = x[:, t, None] * up, x_prev[:, None] * up
        new = torch.einsum("brhp,brhn->bhpn", v, k)
        old = torch.einsum("brhp,brhn->bhpn", v_prev, k_prev)
        S = a[..., None, None] * S + ((1 - lam) * dt[:, t] * a)[..., None, None] * old \
            + (lam * dt[:, t])[..., None, None] * new
        o = torch.einsum("bhpn,brhn->brhp", S, q)
        if D is not None:
            o = o + D[:, None] * v
        if z is not None:
            g = z[:, t, None] * mz.transpose(0, 1)
            o = o * g / (1 + torch.exp(-g))
        ys.append(o if mo is None else (o * mo.transpose(0, 1)).sum(1))
        k_prev, x_prev = k, x[:, t]
    return torch.stack(ys, 1), theta, S, k_prev, x_prev


def siso_referee(x, B, C, dt, adt, trap, angles, Bb, Cb, D, z, a0, s0, k0, v0):
    H, P = x.shape[2:]
    ones = torch.ones(H, 1, P, dtype=x.dtype)
    y, theta, S, k, v = referee(x, B.unsqueeze(2), C.unsqueeze(2), dt, adt, trap, angles,
                                None if Bb is None else Bb.unsqueeze(1), None if Cb is None else Cb.unsqueeze(1),
                                ones, ones, ones, D, z, a0, s0, None if k0 is None else k0.unsqueeze(1), v0,
                                halves=False)
    return y, theta, S, k.squeeze(1), v


def mimo_referee(*args):
    return referee(*args, halves=True)


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def make_inputs(b, L, H, P, G, N, S, R=None, init=True, extras=True, seed=0):
    """SISO argument list when R is None, else MIMO's (see the op signatures)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    bc = (b, L, G, N) if R is None else (b, L, R, G, N)
    bias = (H, N) if R is None else (H, R, N)
    dt = torch.nn.functional.softplus(rnd(b, L, H) - 1)
    adt = -dt * (0.2 + torch.rand(b, L, H, generator=g, dtype=torch.float64))
    args = [rnd(b, L, H, P), rnd(*bc, scale=0.5), rnd(*bc, scale=0.5), dt, adt, rnd(b, L, H), rnd(b, L, H, S),
            rnd(*bias, scale=0.5) if extras else None, rnd(*bias, scale=0.5) if extras else None]
    if R is not None:
        args += [1 + rnd(H, R, P, scale=0.3), rnd(H, R, P) if extras else None, rnd(H, R, P, scale=0.5)]
    args += [rnd(H) if extras else None, rnd(b, L, H, P) if extras else None]
    k_shape = (b, H, N) if R is None else (b, R, H, N)
    args += [rnd(b, H, S, scale=3).abs(), rnd(b, H, P, N, scale=0.5), rnd(*k_shape, scale=0.5), rnd(b, H, P)] \
        if init else [None] * 4
    return args


def run_siso(chunk):
    def fn(*a):
        y, st = mamba3_siso(*a[:7], B_bias=a[7], C_bias=a[8], D=a[9], z=a[10], initial_state=a[11:15],
                            chunk_size=chunk, return_final_state=True)
        return (y, *st)
    return fn


def run_mimo(chunk):
    def fn(*a):
        y, st = mamba3_mimo(*a[:7], B_bias=a[7], C_bias=a[8], mimo_x=a[9], mimo_z=a[10], mimo_o=a[11], D=a[12],
                            z=a[13], initial_state=Mamba3State(*a[14:18]), chunk_size=chunk,
                            return_final_state=True)
        return (y, *st)
    return fn


SISO_SHAPES = [  # b, L, H, P, G, N, S, chunk
    (2, 7, 3, 4, 1, 8, 2, 4),    # length not a multiple of the chunk, odd heads, partial rotation
    (1, 16, 2, 3, 2, 6, 3, 8),   # every pair rotated, one group per head
    (2, 5, 6, 2, 3, 4, 1, 64),   # chunk longer than the sequence
    (1, 1, 1, 2, 1, 2, 1, 4),    # a single step
]


@pytest.mark.parametrize("b,L,H,P,G,N,S,chunk", SISO_SHAPES)
@pytest.mark.parametrize("init", [False, True])
def test_siso_matches_referee(b, L, H, P, G, N, S, chunk, init):
    args = make_inputs(b, L, H, P, G, N, S, init=init, seed=L * 10 + H + init)
    compare_fwd_bwd(run_siso(chunk), siso_referee, args, tol=1e-5)


def test_siso_without_bias_skip_or_gate():
    args = make_inputs(2, 9, 3, 2, 3, 4, 2, extras=False, seed=5)
    compare_fwd_bwd(run_siso(4), siso_referee, args, tol=1e-5)


MIMO_SHAPES = [  # b, L, H, P, G, N, S, R, chunk
    (2, 7, 3, 4, 1, 8, 2, 1, 4),
    (1, 10, 2, 3, 2, 8, 4, 2, 4),
    (2, 6, 3, 2, 1, 4, 1, 3, 16),
]


@pytest.mark.parametrize("b,L,H,P,G,N,S,R,chunk", MIMO_SHAPES)
@pytest.mark.parametrize("init", [False, True])
def test_mimo_matches_referee(b, L, H, P, G, N, S, R, chunk, init):
    args = make_inputs(b, L, H, P, G, N, S, R=R, init=init, seed=L * 10 + R + init)
    compare_fwd_bwd(run_mimo(chunk), mimo_referee, args, tol=1e-5)


def test_mimo_per_rank_output_without_gate():
    args = make_inputs(1, 9, 2, 3, 1, 4, 2, R=2, extras=False, seed=7)
    args[11] = None                                           # no mimo_o: y is (b, l, r, h, p)
    y = run_mimo(4)(*[a if a is None else a.float() for a in args])[0]
    assert y.shape == (1, 9, 2, 2, 3)
    compare_fwd_bwd(run_mimo(4), mimo_referee, args, tol=1e-5)


def in_two(run, per_step, at):
    """Run the first ``at`` steps, carry the final state into the rest, concatenate the outputs.
    ``per_step`` are the argument positions with a time axis; the last four are the initial state."""
    def fn(*a):
        def part(steps, state):
            args = [t[:, steps] if i in per_step and t is not None else t for i, t in enumerate(a)]
            return run(*args[:-4], *state)
        first = part(slice(None, at), a[-4:])
        second = part(slice(at, None), first[1:])
        return (torch.cat([first[0], second[0]], 1), *second[1:])
    return fn


@pytest.mark.parametrize("init", [False, True])
def test_siso_split_sequence_carries_state(init):
    args = make_inputs(2, 13, 3, 2, 1, 6, 2, init=init, seed=11)
    compare_fwd_bwd(in_two(run_siso(4), {0, 1, 2, 3, 4, 5, 6, 10}, at=6), siso_referee, args, tol=1e-5)


@pytest.mark.parametrize("R", [1, 2])
def test_mimo_split_sequence_carries_state(R):
    args = make_inputs(1, 11, 2, 3, 1, 8, 2, R=R, init=True, seed=13)
    compare_fwd_bwd(in_two(run_mimo(4), {0, 1, 2, 3, 4, 5, 6, 13}, at=5), mimo_referee, args, tol=1e-5)


def test_chunk_size_does_not_change_the_result():
    args = [a if a is None else a.float() for a in make_inputs(2, 11, 3, 2, 1, 4, 2, seed=17)]
    outs = [run_siso(c)(*args) for c in (1, 3, 64)]
    for o in outs[1:]:
        for a, b in zip(o, outs[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    siso = [a.requires_grad_() if a is not None else None for a in make_inputs(1, 3, 2, 2, 1, 4, 1, seed=19)]
    assert torch.autograd.gradcheck(run_siso(2), siso, fast_mode=True)
    mimo = [a.requires_grad_() if a is not None else None for a in make_inputs(1, 3, 1, 2, 1, 4, 1, R=2, seed=23)]
    assert torch.autograd.gradcheck(run_mimo(2), mimo, fast_mode=True)


def test_dtypes_and_fake_agree_with_eager():
    for run, args in ((run_siso(4), make_inputs(2, 5, 3, 2, 1, 4, 2, seed=29)),
                      (run_mimo(4), make_inputs(2, 5, 3, 2, 1, 4, 2, R=2, seed=31))):
        half = [None if a is None else a.to(torch.bfloat16) for a in args]
        real = run(*half)
        assert real[0].dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in real[1:])
        assert all(s.dtype == torch.float64 for s in run(*args)[1:])
        with FakeTensorMode() as mode:
            fake = run(*[None if a is None else mode.from_tensor(a) for a in half])
        assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real]


def test_info_names_match_schema():
    for info in (SISO_INFO, MIMO_INFO):
        schema = info.op.default._schema
        assert tuple(a.name for a in schema.arguments) == info.arg_names
        assert len(schema.returns) == info.n_outputs == len(info.extra["output_names"])


def test_bad_input_is_clear():
    good = [None if a is None else a.float() for a in make_inputs(1, 4, 2, 2, 1, 4, 1, seed=37)]
    siso = run_siso(4)
    with pytest.raises(MambacInputError, match="B must be"):
        siso(good[0], good[1][0], *good[2:])
    with pytest.raises(MambacInputError, match="multiple of groups"):
        siso(good[0], torch.randn(1, 4, 3, 4), torch.randn(1, 4, 3, 4), *good[3:])
    with pytest.raises(MambacInputError, match="angles need"):
        siso(*good[:6], torch.randn(1, 4, 2, 3), *good[7:])
    with pytest.raises(MambacInputError, match="floating-point"):
        siso(good[0].long(), *good[1:])
    with pytest.raises(MambacInputError, match="initial_state.ssm has shape"):
        siso(*good[:12], torch.zeros(1, 2, 4, 2), *good[13:])
    with pytest.raises(MambacInputError, match="chunk_size"):
        run_siso(0)(*good)
    mimo = [None if a is None else a.float() for a in make_inputs(1, 4, 2, 2, 1, 4, 1, R=2, seed=41)]
    with pytest.raises(MambacInputError, match="mimo_z"):
        run_mimo(4)(*mimo[:10], None, *mimo[11:])
    with pytest.raises(MambacInputError, match="mimo_x has shape"):
        run_mimo(4)(*mimo[:9], torch.ones(2, 3, 2), *mimo[10:])
    with pytest.raises(MambacInputError, match="dstate must be even"):
        bad = torch.randn(1, 4, 2, 1, 5)
        run_mimo(4)(mimo[0], bad, bad, *mimo[3:7], None, None, *mimo[9:])
