"""linear_cross_entropy against F.cross_entropy(hidden @ W.T) in float64: forward, both gradients,
chunks not dividing N, ignored tokens, tied weights, bf16 autocast, the all-ignored nan, errors."""
import pytest
import torch
import torch.nn.functional as F

from mambac.errors import MambacInputError
from mambac.ops import linear_cross_entropy
from mambac.ops.linear_cross_entropy import CHUNK_FP32_BYTES, default_chunk
from tests.helpers import compare_fwd_bwd, rel_err


def _inputs(n, d, v, seed=0, ignore_every=0):
    g = torch.Generator().manual_seed(seed)
    hidden, weight = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden, weight, labels


def _ref(h, w, labels, ignore_index=-100):
    return F.cross_entropy(h @ w.T, labels, ignore_index=ignore_index)


@pytest.mark.parametrize("n,d,v,chunk,ignore_every", [
    (24, 16, 40, 8, 0),      # chunk divides N
    (23, 16, 41, 5, 3),      # it does not; a third of the tokens ignored
    (7, 5, 11, 100, 2),      # one chunk larger than N
    (9, 8, 13, 1, 4),        # one token per chunk
])
def test_matches_cross_entropy_fp32_and_fp64(n, d, v, chunk, ignore_every):
    h, w, labels = _inputs(n, d, v, ignore_every=ignore_every)
    fn = lambda h, w: linear_cross_entropy(h, w, labels, chunk=chunk)   # noqa: E731
    ref = lambda h, w: _ref(h, w, labels)                               # noqa: E731
    compare_fwd_bwd(fn, ref, [h, w], dtype=torch.float32, tol=1e-5)
    compare_fwd_bwd(fn, ref, [h, w], dtype=torch.float64, tol=1e-12)


def test_other_ignore_index_and_default_chunk():
    h, w, labels = _inputs(30, 8, 17, seed=1)
    assert (labels == 3).any()
    got = linear_cross_entropy(h.double(), w.double(), labels, ignore_index=3)
    assert rel_err(got, _ref(h.double(), w.double(), labels, ignore_index=3)) < 1e-12
    assert default_chunk(50288) * 50288 * 4 <= CHUNK_FP32_BYTES and default_chunk(50288) >= 1024
    assert default_chunk(10 ** 12) == 1


def test_all_ignored_gives_nan_and_zero_grads_like_cross_entropy():
    h, w, _ = _inputs(10, 6, 9)
    labels = torch.full((10,), -100)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    got, ref = linear_cross_entropy(h1, w1, labels, chunk=4), _ref(h2, w2, labels)
    assert torch.isnan(got) and torch.isnan(ref) and got.dtype == ref.dtype == torch.float32
    got.backward()
    ref.backward()
    assert torch.equal(h1.grad, h2.grad) and torch.equal(w1.grad, w2.grad)


def test_tied_weight_gradients_add_up():
    v, d, b, l = 19, 8, 2, 7
    g = torch.Generator().manual_seed(2)
    ids, labels = torch.randint(0, v, (b, l), generator=g), torch.randint(0, v, (b * l,), generator=g)
    labels[::5] = -100
    w0 = torch.randn(v, d, generator=g, dtype=torch.float64)

    def loss(w, fused):
        h = torch.tanh(F.embedding(ids, w)).flatten(0, 1)     # the same weight embeds and projects
        return linear_cross_entropy(h, w, labels, chunk=3) if fused else _ref(h, w, labels)

    w_ref, w_f32 = w0.clone().requires_grad_(), w0.float().requires_grad_()
    loss(w_ref, False).backward()
    out = loss(w_f32, True)
    out.backward()
    assert rel_err(out, loss(w0, False)) < 1e-5 and rel_err(w_f32.grad, w_ref.grad) < 1e-5


def test_bf16_autocast_runs_matmuls_in_bf16_and_matches():
    h, w, labels = _inputs(21, 16, 33, seed=3, ignore_every=4)
    h_ref, w_ref = h.double().requires_grad_(), w.double().requires_grad_()
    ref = _ref(h_ref, w_ref, labels)
    ref.backward()
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(hb, wb, labels, chunk=6)
        eager = F.cross_entropy(F.linear(h, w).float(), labels)
    got.backward()
    assert got.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.float32
    assert rel_err(got, ref) < 1e-2 and rel_err(hb.grad, h_ref.grad) < 1e-2 and rel_err(wb.grad, w_ref.grad) < 1e-2
    assert rel_err(got, eager) < 1e-3        # the same bf16 logits as the unfused eager head
    assert rel_err(got, _ref(h, w, labels)) > 1e-7   # and not the fp32 ones: autocast was honoured


def test_float64_under_autocast_stays_float64_like_the_eager_head():
    h, w, labels = _inputs(9, 8, 13, seed=5)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h64, w64, labels, chunk=4)
        eager = F.cross_entropy(F.linear(h.double(), w.double()), labels)
    got.backward()
    assert got.dtype == torch.float64 and h64.grad.dtype == w64.grad.dtype == torch.float64
    assert rel_err(got, eager) < 1e-12


def test_bad_inputs_raise_clear_errors():
    h, w, labels = _inputs(6, 4, 5)
    with pytest.raises(MambacInputError, match="hidden \\(N, D\\)"):
        linear_cross_entropy(h.view(2, 3, 4), w, labels)
    with pytest.raises(MambacInputError, match="disagree"):
        linear_cross_entropy(h, w[:, :3], labels)
    with pytest.raises(MambacInputError, match="disagree"):
        linear_cross_entropy(h, w, labels[:5])
    with pytest.raises(MambacInputError, match="int64"):
        linear_cross_entropy(h, w, labels.float())
    with pytest.raises(MambacInputError, match="floating point"):
        linear_cross_entropy(h.long(), w, labels)
    with pytest.raises(MambacInputError, match="bias-free"):
        linear_cross_entropy(h, w, labels, bias=torch.zeros(5))
    with pytest.raises(MambacInputError, match="chunk"):
        linear_cross_entropy(h, w, labels, chunk=0)
