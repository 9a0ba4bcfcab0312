"""fuse_ssm on small hand-written graphs: printed graph after, match counts, numerics, and the
cases that must NOT fuse."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mambac
from mambac import ops
from tests.helpers import rel_err


class SSDBlock(nn.Module):
    """Unfused math around a bare ssd, the way users write it."""

    def __init__(self, h=3, p=4, leak_dt=False, gate_first=False):
        super().__init__()
        self.dt_bias = nn.Parameter(torch.randn(h))
        self.D = nn.Parameter(torch.randn(h))
        self.h, self.p, self.leak_dt, self.gate_first = h, p, leak_dt, gate_first

    def forward(self, x, dt, A, B, C, z):
        dt2 = F.softplus(dt + self.dt_bias).clamp(min=0.01, max=2.0)
        y = ops.ssd(x, dt2, A, B, C, chunk_size=4)
        if self.gate_first:
            y = y * F.silu(z)
            y = y + x * self.D.unsqueeze(-1)
        else:
            y = y + x * self.D.unsqueeze(-1)
            y = y * F.silu(z)
        return (y, dt2) if self.leak_dt else y

    def example_inputs(self):
        b, l, g, n = 2, 7, 1, 5
        return (torch.randn(b, l, self.h, self.p), torch.randn(b, l, self.h), -torch.rand(self.h) - 0.5,
                torch.randn(b, l, g, n), torch.randn(b, l, g, n), torch.randn(b, l, self.h, self.p))


def _stats(compiled):
    return next(iter(compiled.programs.values())).ctx.stats["fuse_ssm"].counts


def _check_numerics(model, compiled):
    inputs = model.example_inputs()
    out_e, out_c = model(*inputs), compiled(*inputs)
    for a, b in zip(out_c if isinstance(out_c, tuple) else (out_c,), out_e if isinstance(out_e, tuple) else (out_e,)):
        assert rel_err(a, b) <= 1e-5


def test_everything_around_ssd_folds_into_one_node():
    model = SSDBlock()
    compiled = mambac.compile(model)
    assert _stats(compiled) == {"dt_prologue": 1, "delta_prologue": 0, "d_skip": 1, "z_gate": 1,
                                "conv_silu": 0, "add_rmsnorm": 0}
    text = compiled.lowered_graph_text()
    lines = [ln.strip() for ln in text.splitlines()]
    ssd_line = next(ln for ln in lines if ln.startswith("ssd = mambac.ssd("))
    assert ssd_line.startswith("ssd = mambac.ssd(x, dt, a, b, c, d, z, dt_bias, None, 4, True, 0.01, 2.0)")
    assert "fused: dt_prologue+d_skip+z_gate" in ssd_line
    # the op and one getitem remain between the parameters and the output
    body = [ln for ln in lines[2:] if not ln.startswith(("x =", "dt =", "a =", "b =", "c =", "z ="))]
    assert [ln.split(" = ")[0] for ln in body] == ["dt_bias", "d", "ssd", "getitem", "return getitem"]
    _check_numerics(model, compiled)


def test_no_fusion_when_intermediate_is_used_elsewhere():
    model = SSDBlock(leak_dt=True)
    compiled = mambac.compile(model)
    assert _stats(compiled)["dt_prologue"] == 0
    assert _stats(compiled)["d_skip"] == 1
    _check_numerics(model, compiled)


def test_gate_before_skip_is_not_reordered():
    model = SSDBlock(gate_first=True)
    compiled = mambac.compile(model)
    stats = _stats(compiled)
    assert stats["z_gate"] == 1 and stats["d_skip"] == 0  # y*silu(z) + x*D ≠ (y + x*D)*silu(z)
    _check_numerics(model, compiled)


class ConvNorm(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.w, self.b, self.nw = nn.Parameter(torch.randn(d, 4)), nn.Parameter(torch.randn(d)), nn.Parameter(torch.rand(d))

    def forward(self, x, res):
        y = F.silu(ops.causal_conv1d(x.transpose(1, 2), self.w, self.b)).transpose(1, 2)
        out, r = ops.add_rmsnorm(y + res, None, self.nw, 1e-5, True)
        return out, r

    def example_inputs(self):
        return torch.randn(2, 5, 6), torch.randn(2, 5, 6)


def test_conv_silu_and_residual_add_fold():
    model = ConvNorm()
    compiled = mambac.compile(model)
    stats = _stats(compiled)
    assert stats["conv_silu"] == 1 and stats["add_rmsnorm"] == 1
    text = compiled.lowered_graph_text()
    assert "'silu')" in text and "mambac.add_rmsnorm(transpose_1, res, nw, 1e-05, True)" in text
    _check_numerics(model, compiled)


def test_disabling_fuse_ssm_keeps_the_math():
    model = SSDBlock()
    compiled = mambac.compile(model, disable_passes=("fuse_ssm",))
    assert "fuse_ssm" not in next(iter(compiled.programs.values())).ctx.stats
    assert "F.softplus" in compiled.lowered_graph_text()
    _check_numerics(model, compiled)


class SumReadAgain(nn.Module):
    """A residual sum that is normed and read again (a block's next residual), after the norm or
    before it."""

    def __init__(self, d=6, read_before=False):
        super().__init__()
        self.nw, self.read_before = nn.Parameter(torch.rand(d)), read_before

    def forward(self, a, b):
        s = a + b
        early = s * 2 if self.read_before else None
        out, _ = ops.add_rmsnorm(s, None, self.nw, 1e-5, False)
        return out + (early if self.read_before else s * 3)

    def example_inputs(self):
        return torch.randn(2, 5, 6), torch.randn(2, 5, 6)


@pytest.mark.parametrize("read_before", [False, True])
def test_sum_read_again_folds_only_when_read_after_the_norm(read_before):
    """Read after the op: the add folds and the later read takes the op's residual output.  Read
    before it: nothing can take the op's output there, so the add stays."""
    model = SumReadAgain(read_before=read_before)
    compiled = mambac.compile(model)
    assert _stats(compiled)["add_rmsnorm"] == (0 if read_before else 1)
    text = compiled.lowered_graph_text()
    assert ("mambac.add_rmsnorm(a, b, nw, 1e-05, False)" in text) == (not read_before)
    if not read_before:  # the later read (s * 3) takes the op's residual output
        residual = next(ln.split(" = ")[0].strip() for ln in text.splitlines()
                        if "operator.getitem(add_rmsnorm, 1)" in ln)
        assert f"operator.mul({residual}, 3)" in text
    _check_numerics(model, compiled)
