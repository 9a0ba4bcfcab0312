import pytest
import torch

from mambac.errors import MambacInputError
from mambac.ops import add_rmsnorm, gated_rmsnorm, rms_norm
from tests.helpers import compare_fwd_bwd, rel_err


def gated_referee(x, w, z, eps, gs, nbg):
    """Loop over groups, straight from the definition."""
    if z is not None and not nbg:
        x = x * z * torch.sigmoid(z)
    parts = []
    for s in range(0, x.shape[-1], gs):
        g = x[..., s:s + gs]
        parts.append(g / torch.sqrt((g * g).sum(-1, keepdim=True) / gs + eps))
    out = torch.cat(parts, -1) * w
    if z is not None and nbg:
        out = out * z * torch.sigmoid(z)
    return out


@pytest.mark.parametrize("shape,gs", [((2, 5, 8), 8), ((2, 5, 12), 4), ((1, 1, 6), 3), ((3, 7), 7)])
@pytest.mark.parametrize("gate", [None, "before", "after"])
def test_gated_rmsnorm(shape, gs, gate):
    g = torch.Generator().manual_seed(sum(shape) + gs)
    x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
    z = None if gate is None else torch.randn(*shape, generator=g)
    nbg = gate == "before"
    compare_fwd_bwd(lambda x, w, z: gated_rmsnorm(x, w, z, 1e-5, gs, nbg),
                    lambda x, w, z: gated_referee(x, w, z, 1e-5, gs, nbg), [x, w, z])


@pytest.mark.parametrize("with_res", [False, True])
@pytest.mark.parametrize("fp32_res", [False, True])
def test_add_rmsnorm(with_res, fp32_res):
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(2, 9, 16, generator=g), torch.randn(16, generator=g)
    r = torch.randn(2, 9, 16, generator=g) if with_res else None

    def ref(x, r, w):
        h = x if r is None else x + r
        return gated_referee(h, w, None, 1e-6, 16, False), h

    compare_fwd_bwd(lambda x, r, w: add_rmsnorm(x, r, w, 1e-6, fp32_res), ref, [x, r, w])


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float32])
def test_bf16_residual_in_fp32(wdtype):
    """The residual stream stays fp32; the normalised output takes the weight's dtype (a bf16
    model's mixer gets bf16 even though the sum it normalises is fp32)."""
    x = torch.randn(2, 4, 8).bfloat16()
    r = torch.randn(2, 4, 8)
    w = torch.randn(8).to(wdtype)
    out, res = add_rmsnorm(x, r, w, 1e-5, True)
    assert out.dtype == wdtype and res.dtype == torch.float32
    assert rel_err(res, x.float() + r) == 0.0
    assert rel_err(out, gated_referee(x.double() + r.double(), w.double(), None, 1e-5, 8, False)) < 1e-2
    out, res = add_rmsnorm(res, None, w, 1e-5, True)   # the fp32 sum alone, as an unfused block passes it
    assert out.dtype == wdtype and res.dtype == torch.float32


def test_rms_norm_does_not_alias_input():
    x = torch.randn(3, 4)
    out, res = add_rmsnorm(x, None, torch.ones(4))
    assert res.data_ptr() != x.data_ptr()
    assert rel_err(rms_norm(x, torch.ones(4)), out) == 0.0


def test_bad_input():
    with pytest.raises(MambacInputError, match="group_size 5 must divide"):
        gated_rmsnorm(torch.randn(2, 8), torch.ones(8), group_size=5)
    with pytest.raises(MambacInputError, match="residual has shape"):
        add_rmsnorm(torch.randn(2, 8), torch.randn(2, 4), torch.ones(8))


def test_opcheck_with_non_contiguous_inputs():
    """Fake functions agree with the real ops (shapes, dtypes and contiguous strides)."""
    x = torch.randn(2, 8, 5).transpose(1, 2)
    z = torch.randn(2, 8, 5).transpose(1, 2)
    torch.library.opcheck(torch.ops.mambac.gated_rmsnorm.default, (x, torch.randn(8), z, 1e-5, 4, False),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(torch.ops.mambac.add_rmsnorm.default, (x, None, torch.randn(8), 1e-5, True),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
