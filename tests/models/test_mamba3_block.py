import pytest
import torch
import torch.fx

from mambac.errors import MambacConfigError
from mambac.models.mamba3 import Mamba3, heavy_tail

SMALL = dict(d_model=16, d_state=8, headdim=4, ngroups=2, chunk_size=4)
CONFIGS = {
    "siso": dict(SMALL),
    "siso_outproj_norm_full_rope": dict(SMALL, is_outproj_norm=True, rope_fraction=1.0),
    "mimo_r2": dict(SMALL, is_mimo=True, mimo_rank=2),
    "mimo_r3_outproj_norm": dict(SMALL, is_mimo=True, mimo_rank=3, is_outproj_norm=True, ngroups=1),
}


def block(name, seed=0, **over):
    torch.manual_seed(seed)
    m = Mamba3(**dict(CONFIGS[name], **over))
    with torch.no_grad():  # move the fp32 parameters off their constant initial values
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("name", list(CONFIGS))
def test_output_shape_and_finite(name):
    m = block(name)
    u = torch.randn(2, 7, 16)
    out = m(u)
    assert out.shape == (2, 7, 16) and out.dtype == u.dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fx_symbolic_trace_matches_eager(name):
    m = block(name)
    gm = torch.fx.symbolic_trace(m)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    scan = "mambac.mamba3_mimo" if m.is_mimo else "mambac.mamba3_siso"
    assert scan in targets
    u = torch.randn(2, 6, 16)
    torch.testing.assert_close(gm(u), m(u), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_reach_every_parameter(name):
    m = block(name)
    m(torch.randn(2, 5, 16)).square().sum().backward()
    for pname, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


def test_state_dict_layout_matches_mamba_ssm():
    # d_inner 32, 8 heads of 4, 2 groups, d_state 8, rope 0.5 -> 2 angles, rank 2:
    # in_proj rows = 2*32 + 2*(8*2*2) + 3*8 + 2 = 154
    m = block("mimo_r2")
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    assert shapes == {
        "dt_bias": (8,), "B_bias": (8, 2, 8), "C_bias": (8, 2, 8), "mimo_x": (8, 2, 4), "mimo_z": (8, 2, 4),
        "mimo_o": (8, 2, 4), "D": (8,), "in_proj.weight": (154, 16), "B_norm.weight": (8,),
        "C_norm.weight": (8,), "out_proj.weight": (16, 32)}
    siso = {k: tuple(v.shape) for k, v in block("siso_outproj_norm_full_rope").state_dict().items()}
    assert siso["in_proj.weight"] == (2 * 32 + 2 * 16 + 24 + 4, 16) and siso["norm.weight"] == (32,)
    assert siso["B_bias"] == (8, 1, 8) and "mimo_x" not in siso


def test_chunk_size_and_dtype_do_not_change_the_result():
    u = torch.randn(1, 9, 16, dtype=torch.float64)
    ref = block("mimo_r2", chunk_size=64).double()(u)
    out = block("mimo_r2", chunk_size=2)(u.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_sequence_is_causal():
    m = block("siso")
    u = torch.randn(1, 8, 16)
    v = u.clone()
    v[:, 5:] += 1.0
    torch.testing.assert_close(m(u)[:, :5], m(v)[:, :5])
    assert not torch.allclose(m(u)[:, 5:], m(v)[:, 5:])


def test_heavy_tail_is_positive_and_continuous():
    x = torch.tensor([-1e6, -3.0, -1e-7, 0.0, 1e-7, 2.0], requires_grad=True)
    y = heavy_tail(x)
    assert (y > 0).all()
    torch.testing.assert_close(y, torch.tensor([1 / (1 + 1e6), 0.25, 1.0, 1.0, 1.0, 3.0]))
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("over,match", [(dict(rope_fraction=0.25), "rope_fraction"),
                                        (dict(ngroups=3), "ngroups"), (dict(headdim=5), "headdim")])
def test_bad_config_is_clear(over, match):
    with pytest.raises(MambacConfigError, match=match):
        Mamba3(**dict(SMALL, **over))
