"""mambac.runtime.replay, the recompute that plan_remat's regions run through: gradients equal to
plain autograd's (float64 referee) for awkward bodies, parameter gradients through autograd's own
accumulators, the forward's autocast and kernel mode in the replay, only the inputs kept."""
import pytest
import torch
import torch.nn as nn

import mambac
from mambac.memory import measure_saved
from mambac.passes.plan_remat import RematRegion
from mambac.runtime.replay import replay
from tests.models.tiny import tiny_lm


class Body(nn.Module):
    """Uses its weight twice, takes a non-tensor argument, returns a nested tuple holding an input
    passed through, an integer tensor and a None."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 5, dtype=torch.float64))
        self.frozen = nn.Parameter(torch.randn(5, dtype=torch.float64), requires_grad=False)

    def forward(self, x, scale, y):
        h = torch.tanh(x @ self.w) * scale + self.frozen
        return (h @ self.w, (y, h.argmax(-1))), None, h.sum()


def loss_of(out):
    (a, (y, idx)), none, s = out
    assert none is None and idx.dtype == torch.int64
    return (a.square().sum() + (y * 3).sum() + s * 2)


def inputs():
    return (torch.randn(4, 5, dtype=torch.float64, requires_grad=True), 0.7,
            torch.randn(3, dtype=torch.float64, requires_grad=True))


def test_gradients_equal_plain_autograd_on_an_awkward_body():
    body = Body()
    x, scale, y = inputs()
    want = torch.autograd.grad(loss_of(body(x, scale, y)), [x, y, body.w])
    out = replay(body, (x, scale, y), "reference", dict(body.named_parameters()))
    assert out[0][1][0] is not y and torch.equal(out[0][1][0], y)   # a passed-through input
    assert not out[0][1][1].requires_grad                            # the integer output
    got = torch.autograd.grad(loss_of(out), [x, y, body.w])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert body.w.grad is None      # torch.autograd.grad of the caller: nothing lands in .grad


def test_parameter_gradients_accumulate_like_plain_backward():
    body = Body()
    x, scale, y = inputs()
    loss_of(body(x, scale, y)).backward()
    want = body.w.grad.clone()
    loss_of(replay(body, (x, scale, y), "reference", dict(body.named_parameters()))).backward()
    torch.testing.assert_close(body.w.grad, 2 * want, rtol=1e-12, atol=1e-12)
    assert body.frozen.grad is None


def test_keeps_only_the_inputs_and_recomputes_the_rest():
    body = Body().float()
    x = torch.randn(64, 5, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    plain = measure_saved(lambda: body(x, 0.5, y)[2], exclude=[*body.parameters()])
    kept = measure_saved(lambda: replay(body, (x, 0.5, y), "reference", dict(body.named_parameters()))[2],
                         exclude=[*body.parameters()])
    assert kept.nbytes == x.nbytes + y.nbytes < plain.nbytes


def test_without_grad_mode_it_only_runs_the_body():
    body = Body()
    x, scale, y = inputs()
    with torch.no_grad():
        out = replay(body, (x, scale, y), "reference", dict(body.named_parameters()))
    assert out[2].grad_fn is None and torch.equal(out[2], body(x, scale, y)[2])


def test_replay_runs_under_the_forward_autocast():
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.autograd.grad(lin(x).float().square().sum(), [x, lin.weight])
        out = replay(lin, (x,), "reference", dict(lin.named_parameters()))
    assert out.dtype == torch.bfloat16
    got = torch.autograd.grad(out.float().square().sum(), [x, lin.weight])
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_double_backward_is_refused_clearly():
    lin = nn.Linear(3, 3).double()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(replay(lin, (x,), "reference", dict(lin.named_parameters())).tanh().sum(), [x],
                               create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        g.sum().backward()


def test_regions_run_through_replay_unless_they_draw_random_numbers(monkeypatch):
    import mambac.runtime.replay as rp
    calls = []
    real = rp.replay
    monkeypatch.setattr(rp, "replay", lambda *a: calls.append(1) or real(*a))
    model = tiny_lm("mamba2")
    ids = torch.randint(0, 37, (2, 12))
    full = mambac.compile(model, remat="full", example_inputs=(ids, ids))
    full(ids, ids).backward()
    regions = [m for m in full.program_for(ids, ids).gm.children() if isinstance(m, RematRegion)]
    assert len(calls) == len(regions) == 2


class Wrapped(nn.Module):
    """Runs its body through replay, as RematRegion does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Body()

    def forward(self, x, scale, y):
        return replay(self.body, (x, scale, y), "reference", dict(self.body.named_parameters()))


def test_parameters_swapped_in_for_the_forward_are_the_ones_replayed():
    """Under ``torch.func.functional_call`` (as the backend's several-rank program swaps its shards
    in) the forward runs with other tensors in the parameters' places; backward comes after they
    are restored, and the replay still differentiates with respect to the swapped-in tensors."""
    wrapped = Wrapped()
    x, scale, y = inputs()
    source = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    shard = source * 2                                      # not a leaf, as a shard cut by autograd
    plain = torch.autograd.grad(loss_of(torch.func.functional_call(wrapped.body, {"w": shard}, (x, scale, y))),
                                [x, source])
    shard = source * 2
    out = torch.func.functional_call(wrapped, {"body.w": shard}, (x, scale, y))
    got = torch.autograd.grad(loss_of(out), [x, source])
    for g, w in zip(got, plain):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert wrapped.body.w.grad is None
