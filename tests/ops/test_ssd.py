import math

import pytest
import torch

from mambac.errors import MambacInputError
from mambac.ops import ssd
from mambac.ops._common import op_info
from tests.helpers import compare_fwd_bwd, rel_err


def softplus20(v):
    """softplus with the identity above 20, written out for the referee."""
    return torch.where(v > 20, v, torch.log1p(torch.exp(v.clamp(max=20))))


def referee(x, dt, A, B, C, D, z, dt_bias, init, softplus, dt_limit):
    """Direct recurrence, one step at a time: S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t."""
    b, l, h, p = x.shape
    heads_per_group = h // B.shape[2]
    Bh = B[:, :, torch.arange(h) // heads_per_group]  # (b, l, h, n)
    Ch = C[:, :, torch.arange(h) // heads_per_group]
    d = dt if dt_bias is None else dt + dt_bias
    d = softplus20(d) if softplus else d
    if tuple(dt_limit) != (0.0, math.inf):
        d = d.clamp(dt_limit[0], dt_limit[1])
    S = torch.zeros(b, h, p, B.shape[-1], dtype=x.dtype) if init is None else init
    ys = []
    for t in range(l):
        decay = torch.exp(d[:, t] * A)[..., None, None]
        S = decay * S + (d[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((S * Ch[:, t, :, None, :]).sum(-1))
    y = torch.stack(ys, 1)
    if D is not None:
        y = y + x * (D[:, None] if D.dim() == 1 else D)
    if z is not None:
        y = y * z * torch.sigmoid(z)
    return y, S


# (batch, seqlen, heads, headdim, ngroups, dstate, chunk): lengths below, at, above and not a
# multiple of the chunk, L=1, odd head counts, one and several groups.
SHAPES = [(2, 7, 3, 4, 1, 5, 4), (1, 1, 2, 3, 2, 4, 4), (2, 9, 4, 2, 2, 3, 8), (1, 10, 6, 3, 3, 4, 4),
          (1, 16, 5, 2, 1, 8, 8)]
# (D: None / "h" / "hp", z, dt_bias, softplus, dt_limit, initial_state)
OPTIONS = {
    "plain": (None, False, False, False, (0.0, math.inf), False),
    "full": ("h", True, True, True, (0.0, math.inf), True),
    "limit": ("hp", False, True, True, (0.05, 0.6), True),
    "raw_dt_init": ("hp", True, False, False, (0.0, math.inf), True),
}


def make_inputs(shape, options, seed):
    b, l, h, p, g, n, _ = shape
    D_kind, with_z, with_bias, softplus, _, with_init = options
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    x = rnd(b, l, h, p)
    dt = rnd(b, l, h) - 1.0 if softplus else torch.rand(b, l, h, generator=gen) * 0.9 + 0.05
    A = -(torch.rand(h, generator=gen) * 1.5 + 0.3)
    B, C = rnd(b, l, g, n), rnd(b, l, g, n)
    D = None if D_kind is None else rnd(h) if D_kind == "h" else rnd(h, p)
    z = rnd(b, l, h, p) if with_z else None
    dt_bias = rnd(h) * 0.5 if with_bias else None
    init = rnd(b, h, p, n) if with_init else None
    return [x, dt, A, B, C, D, z, dt_bias, init]


def run_pair(chunk, options):
    softplus, limit = options[3], options[4]

    def fn(x, dt, A, B, C, D, z, dt_bias, init):
        return ssd(x, dt, A, B, C, chunk_size=chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=softplus,
                   dt_limit=limit, initial_state=init, return_final_state=True)

    def ref(x, dt, A, B, C, D, z, dt_bias, init):
        return referee(x, dt, A, B, C, D, z, dt_bias, init, softplus, limit)

    return fn, ref


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_matches_referee_fp32(shape, opt):
    inputs = make_inputs(shape, OPTIONS[opt], seed=sum(shape))
    fn, ref = run_pair(shape[-1], OPTIONS[opt])
    compare_fwd_bwd(fn, ref, inputs, tol=1e-5)


def test_output_dtypes():
    inputs = make_inputs(SHAPES[0], OPTIONS["full"], seed=1)
    fn, _ = run_pair(4, OPTIONS["full"])
    y, final = fn(*[t if t is None else t.bfloat16() for t in inputs])
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    y, final = fn(*[t if t is None else t.double() for t in inputs])
    assert y.dtype == torch.float64 and final.dtype == torch.float64
    assert tuple(y.shape) == tuple(inputs[0].shape) and tuple(final.shape) == (2, 3, 4, 5)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]])
def test_bf16_close(shape):
    # Round the inputs to bf16 first so the referee sees exactly the values the op sees.
    inputs = [t if t is None else t.bfloat16().float() for t in make_inputs(shape, OPTIONS["full"], seed=5)]
    fn, ref = run_pair(shape[-1], OPTIONS["full"])
    compare_fwd_bwd(fn, ref, inputs, dtype=torch.bfloat16, tol=1e-2)


def test_gradcheck_float64():
    inputs = make_inputs((1, 5, 2, 2, 1, 2, 2), OPTIONS["full"], seed=7)
    args = [t.double().requires_grad_() for t in inputs]
    fn, _ = run_pair(2, OPTIONS["full"])
    assert torch.autograd.gradcheck(fn, args)


def test_chunk_size_independent():
    inputs = make_inputs((2, 37, 4, 3, 2, 4, 0), OPTIONS["full"], seed=11)
    results = []
    for chunk in (4, 16):
        leaves = [t if t is None else t.clone().requires_grad_() for t in inputs]
        y, final = run_pair(chunk, OPTIONS["full"])[0](*leaves)
        (y.square().sum() + final.sum()).backward()
        results.append([y, final] + [leaves[i].grad for i in (0, 1, 2, 3, 8)])
    for a, b in zip(*results):
        assert rel_err(a, b) < 1e-5


def test_registered_info_and_opcheck():
    info = op_info("ssd")
    assert info.arg_names == ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state", "chunk_size",
                              "dt_softplus", "dt_min", "dt_max")
    schema = str(torch.ops.mambac.ssd.default._schema)
    assert "int chunk_size" in schema and schema.endswith("-> (Tensor y, Tensor final_state)")
    x, dt, A, B, C, D, z, dt_bias, init = make_inputs(SHAPES[0], OPTIONS["full"], seed=3)
    args = (x.requires_grad_(), dt, A, B, C, D, z, dt_bias, init, 4, True, 0.0, math.inf)
    # Schema, fake-vs-real outputs and autograd registration (the dynamic-shape AOT check is slow on CPU).
    torch.library.opcheck(torch.ops.mambac.ssd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_fx_trace_records_one_node():
    class Block(torch.nn.Module):
        def forward(self, x, dt, A, B, C):
            return ssd(x, dt, A, B, C, chunk_size=8)

    gm = torch.fx.symbolic_trace(Block())
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "ssd" in str(n.target)]
    assert len(calls) == 1
    inputs = make_inputs(SHAPES[2], OPTIONS["plain"], seed=2)
    assert rel_err(gm(*inputs[:5]), ssd(*inputs[:5], chunk_size=8)) == 0


def test_bad_input_is_clear():
    x, dt, A, B, C = make_inputs(SHAPES[0], OPTIONS["plain"], seed=0)[:5]  # h=3, g=1, n=5
    with pytest.raises(MambacInputError, match=r"heads \(3\) must be a multiple of ngroups \(2\)"):
        ssd(x, dt, A, B.repeat(1, 1, 2, 1), C.repeat(1, 1, 2, 1))
    with pytest.raises(MambacInputError, match="chunk_size must be a positive int"):
        ssd(x, dt, A, B, C, chunk_size=0)
    with pytest.raises(MambacInputError, match=r"D must have shape \(3,\) or \(3, 4\)"):
        ssd(x, dt, A, B, C, D=torch.randn(4))
    with pytest.raises(MambacInputError, match="C has shape"):
        ssd(x, dt, A, B, C[..., :4])
    with pytest.raises(MambacInputError, match="dt has shape"):
        ssd(x, dt[:, :, :2], A, B, C)
    with pytest.raises(MambacInputError, match="initial_state has shape"):
        ssd(x, dt, A, B, C, initial_state=torch.randn(2, 3, 4, 4))
    with pytest.raises(MambacInputError, match="dt_limit"):
        ssd(x, dt, A, B, C, dt_limit=(1.0, 0.5))
    with pytest.raises(MambacInputError, match="floating-point"):
        ssd(x, dt, A.long(), B, C)
    with pytest.raises(MambacInputError, match=r"x must be \(batch, seqlen, heads, headdim\)"):
        ssd(x[0], dt, A, B, C)
