import pytest
import torch

from mambac.errors import MambacInputError
from mambac.ops import causal_conv1d
from tests.helpers import compare_fwd_bwd


def referee(x, w, b, init, act):
    """Direct definition: y[t] = sum_k w[k] * xpad[t + k], xpad = cat(init, x)."""
    B, D, L = x.shape
    W = w.shape[1]
    pre = torch.zeros(B, D, W - 1, dtype=x.dtype) if init is None else init
    xp = torch.cat([pre, x], -1)
    ys = []
    for t in range(L):
        ys.append((xp[..., t:t + W] * w).sum(-1) + (0 if b is None else b))
    y = torch.stack(ys, -1)
    if act == "silu":
        y = y * torch.sigmoid(y)
    return y, xp[..., L:]


@pytest.mark.parametrize("B,D,L,W", [(2, 5, 7, 4), (1, 3, 1, 4), (3, 8, 33, 2), (1, 4, 5, 1)])
@pytest.mark.parametrize("act", ["silu", None])
@pytest.mark.parametrize("with_init", [False, True])
def test_matches_referee(B, D, L, W, act, with_init):
    g = torch.Generator().manual_seed(B * 100 + L)
    x, w, b = torch.randn(B, D, L, generator=g), torch.randn(D, W, generator=g), torch.randn(D, generator=g)
    init = torch.randn(B, D, W - 1, generator=g) if with_init else None
    a = act or "none"
    compare_fwd_bwd(lambda x, w, b, i: causal_conv1d(x, w, b, i, act, return_final_state=True),
                    lambda x, w, b, i: referee(x, w, b, i, a), [x, w, b, init], tol=1e-5)


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(2, 3, 6, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(3, 4, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True),
            torch.randn(2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)]
    assert torch.autograd.gradcheck(lambda *a: causal_conv1d(*a, activation="silu", return_final_state=True), args)


def test_bad_input_is_clear():
    with pytest.raises(MambacInputError, match="weight has shape"):
        causal_conv1d(torch.randn(1, 4, 5), torch.randn(3, 4))
    with pytest.raises(MambacInputError, match="activation"):
        causal_conv1d(torch.randn(1, 4, 5), torch.randn(4, 4), activation="relu")
    with pytest.raises(MambacInputError, match="floating-point"):
        causal_conv1d(torch.ones(1, 4, 5, dtype=torch.long), torch.randn(4, 4))


def test_opcheck_with_non_contiguous_input():
    x = torch.randn(2, 9, 6).transpose(1, 2)  # (b, d, l) view of a (b, l, d) tensor, as in the models
    torch.library.opcheck(torch.ops.mambac.causal_conv1d.default, (x, torch.randn(6, 4), torch.randn(6), None, "silu"),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
