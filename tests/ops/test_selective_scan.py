import pytest
import torch

from mambac.errors import MambacInputError
from mambac.ops import selective_scan
from mambac.ops._common import op_info
from mambac.ops.selective_scan import linear_scan
from tests.helpers import compare_fwd_bwd, rel_err


def per_channel(M, d):
    """(b, n, l) -> broadcast over channels; (b, g, n, l) -> channel i reads group i // (d // g)."""
    if M.dim() == 3:
        return M[:, None].expand(M.shape[0], d, *M.shape[1:])
    return M[:, torch.arange(d) // (d // M.shape[1])]


def referee(u, delta, A, B, C, D, z, delta_bias, init, softplus):
    """Direct recurrence, one step at a time: h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t."""
    b, d, l = u.shape
    dl = delta if delta_bias is None else delta + delta_bias[:, None]
    if softplus:
        dl = torch.where(dl > 20, dl, torch.log1p(torch.exp(dl.clamp(max=20))))
    Bc, Cc = per_channel(B, d), per_channel(C, d)  # (b, d, n, l)
    h = torch.zeros(b, d, A.shape[1], dtype=u.dtype) if init is None else init
    ys = []
    for t in range(l):
        h = torch.exp(dl[..., t, None] * A) * h + (dl[..., t] * u[..., t])[..., None] * Bc[..., t]
        ys.append((h * Cc[..., t]).sum(-1))
    out = torch.stack(ys, -1)
    if D is not None:
        out = out + D[:, None] * u
    if z is not None:
        out = out * z * torch.sigmoid(z)
    return out, h


# (batch, dim, seqlen, dstate, B groups, C groups); None = (batch, dstate, seqlen) shared by all channels.
SHAPES = [(2, 3, 7, 4, None, None), (1, 4, 1, 2, 2, 2), (2, 6, 9, 3, 3, None), (1, 5, 33, 4, 1, 5),
          (2, 4, 16, 2, 2, 4)]
# (D, z, delta_bias, softplus, initial_state)
OPTIONS = {
    "plain": (False, False, False, False, False),
    "full": (True, True, True, True, True),
    "init_raw_delta": (True, False, False, False, True),
}


def make_inputs(shape, options, seed):
    b, d, l, n, gb, gc = shape
    with_D, with_z, with_bias, softplus, with_init = options
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    u = rnd(b, d, l)
    delta = rnd(b, d, l) - 1.0 if softplus else torch.rand(b, d, l, generator=gen) * 0.9 + 0.05
    A = -(torch.rand(d, n, generator=gen) * 1.5 + 0.3)
    B = rnd(b, n, l) if gb is None else rnd(b, gb, n, l)
    C = rnd(b, n, l) if gc is None else rnd(b, gc, n, l)
    D = rnd(d) if with_D else None
    z = rnd(b, d, l) if with_z else None
    bias = rnd(d) * 0.5 if with_bias else None
    init = rnd(b, d, n) if with_init else None
    return [u, delta, A, B, C, D, z, bias, init]


def run_pair(softplus):
    def fn(u, delta, A, B, C, D, z, bias, init):
        return selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=softplus,
                              initial_state=init, return_last_state=True)

    def ref(u, delta, A, B, C, D, z, bias, init):
        return referee(u, delta, A, B, C, D, z, bias, init, softplus)

    return fn, ref


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("opt", list(OPTIONS))
def test_matches_referee_fp32(shape, opt):
    inputs = make_inputs(shape, OPTIONS[opt], seed=sum(s or 0 for s in shape))
    fn, ref = run_pair(OPTIONS[opt][3])
    compare_fwd_bwd(fn, ref, inputs, tol=1e-5)


@pytest.mark.parametrize("L", [1, 2, 3, 5, 8, 13, 31, 32, 33, 70, 1100])
def test_linear_scan_every_length(L):
    # 33 and 70 take the blocked path with a padded last block; 1100 > 32 * 32 recurses twice.
    gen = torch.Generator().manual_seed(L)
    decay = torch.rand(3, L, generator=gen, dtype=torch.float64) * 0.2 + 0.8
    drive = torch.randn(3, L, generator=gen, dtype=torch.float64)
    h, want = torch.zeros(3, dtype=torch.float64), []
    for t in range(L):
        h = decay[:, t] * h + drive[:, t]
        want.append(h)
    assert rel_err(linear_scan(decay, drive), torch.stack(want, -1)) < 1e-13


def test_output_dtypes():
    inputs = make_inputs(SHAPES[2], OPTIONS["full"], seed=1)
    fn, _ = run_pair(True)
    out, last = fn(*[t if t is None else t.bfloat16() for t in inputs])
    assert out.dtype == torch.bfloat16 and last.dtype == torch.float32
    out, last = fn(*[t if t is None else t.double() for t in inputs])
    assert out.dtype == torch.float64 and last.dtype == torch.float64
    assert tuple(out.shape) == (2, 6, 9) and tuple(last.shape) == (2, 6, 3)


@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3]])
def test_bf16_close(shape):
    # Round the inputs to bf16 first so the referee sees exactly the values the op sees.
    inputs = [t if t is None else t.bfloat16().float() for t in make_inputs(shape, OPTIONS["full"], seed=5)]
    fn, ref = run_pair(True)
    compare_fwd_bwd(fn, ref, inputs, dtype=torch.bfloat16, tol=1e-2)


def test_gradcheck_float64():
    inputs = make_inputs((1, 2, 5, 2, 2, None), OPTIONS["full"], seed=7)
    args = [t.double().requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(run_pair(True)[0], args)


def test_registered_info_and_opcheck():
    info = op_info("selective_scan")
    assert info.arg_names == ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial_state",
                              "delta_softplus")
    assert str(torch.ops.mambac.selective_scan.default._schema).endswith("-> (Tensor out, Tensor last_state)")
    u, delta, A, B, C, D, z, bias, init = make_inputs(SHAPES[2], OPTIONS["full"], seed=3)
    args = (u.requires_grad_(), delta, A, B, C, D, z, bias, init, True)
    # Schema, fake-vs-real outputs and autograd registration (the dynamic-shape AOT check is slow on CPU).
    torch.library.opcheck(torch.ops.mambac.selective_scan.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_fx_trace_records_one_node():
    class Block(torch.nn.Module):
        def forward(self, u, delta, A, B, C):
            return selective_scan(u, delta, A, B, C)

    gm = torch.fx.symbolic_trace(Block())
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "selective_scan" in str(n.target)]
    assert len(calls) == 1
    inputs = make_inputs(SHAPES[0], OPTIONS["plain"], seed=2)[:5]
    assert rel_err(gm(*inputs), selective_scan(*inputs)) == 0


def test_bad_input_is_clear():
    u, delta, A, B, C = make_inputs(SHAPES[0], OPTIONS["plain"], seed=0)[:5]  # d=3, l=7, n=4
    with pytest.raises(MambacInputError, match=r"dim \(3\) must be a multiple of B's ngroups \(2\)"):
        selective_scan(u, delta, A, torch.randn(2, 2, 4, 7), C)
    with pytest.raises(MambacInputError, match=r"A must be \(dim, dstate\)"):
        selective_scan(u, delta, A[:, 0], B, C)
    with pytest.raises(MambacInputError, match="C has shape"):
        selective_scan(u, delta, A, B, C[..., :5])
    with pytest.raises(MambacInputError, match="initial_state has shape"):
        selective_scan(u, delta, A, B, C, initial_state=torch.randn(2, 3, 5))
    with pytest.raises(MambacInputError, match="D has shape"):
        selective_scan(u, delta, A, B, C, D=torch.randn(3, 4))
    with pytest.raises(MambacInputError, match="floating-point"):
        selective_scan(u, delta.long(), A, B, C)
    with pytest.raises(MambacInputError, match=r"u must be \(batch, dim, seqlen\)"):
        selective_scan(u[0], delta, A, B, C)
    with pytest.raises(MambacInputError, match="initial_state must be a tensor or None, got bool True; check the order"):
        selective_scan(u, delta, A, B, C, None, None, None, None, True)   # a flag where a tensor goes
