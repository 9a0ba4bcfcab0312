"""The context-parallel SSD on generated kernels (``runtime/cp_ssd_fused``) against the float64
step-by-step referee of the WHOLE sequence, under the Triton interpreter.

W ranks are simulated in one process (``Ranks``): each runs the autograd Function on its piece,
forward and then backward of its own loss, meeting the others in the Function's two gathers.  Checked: y of every piece, every
piece's final state (the referee's state at the piece's end; each gets a nonzero cotangent), and
the gradient of every input summed over the pieces.  Also: which form ``cp_ssd`` picks, and a
GPU-tier check at the benchmark's head sizes.  fp32 <= 1e-4 relative (in norm); one bf16
case (x, dt, B, C, z and the output cotangent rounded to bf16, the referee given the same values)
<= 1e-2.
"""
from __future__ import annotations

import math
import pytest
import torch

from mambac.runtime.collectives import split_sizes, split_start
from mambac.runtime.cp_ssd_fused import Exchange, cp_ssd_fused
from tests.codegen.referee import check_grads, ssd_referee
from tests.helpers import rel_err

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
HALF = ("x", "dt", "B", "C", "z")  # inputs given in the io dtype; the rest stay fp32


class Ranks:
    """W simulated ranks run one after another, each call in two rounds.

    What rank j sends depends on its own inputs only (its summary in the forward, the gradient of
    its incoming state in the backward): a first round records what every rank sends (getting
    zeros for the ranks not yet recorded, its results dropped), the second gets what the others
    sent.  No threads: CUDA autograd runs a Function's backward on the device's own thread, which
    a rank waiting for the others would block."""

    def __init__(self, world: int):
        self.world = world
        self.sent: dict = {}   # (width of the gathered rows, rank) -> tensor

    def exchange(self, rank: int) -> Exchange:
        def gather(t):  # forward rows (b, h*p*n + h) and backward rows (b, h*p*n) differ in width
            self.sent[t.shape[1], rank] = t.detach().clone()
            return torch.stack([self.sent.get((t.shape[1], r), torch.zeros_like(t)) for r in range(self.world)])
        return Exchange(gather=gather, rank=rank)

    def run(self, forward, loss_of, leaves) -> list:
        """``forward(rank, exchange)`` -> outputs, ``loss_of(rank, outputs)`` -> this rank's loss,
        backward into ``leaves``; every rank's outputs."""
        with torch.no_grad():
            for r in range(self.world):
                forward(r, self.exchange(r))
        outs = [forward(r, self.exchange(r)) for r in range(self.world)]
        used = [t for t in leaves if t is not None]
        for r in range(self.world):
            torch.autograd.grad(loss_of(r, outs[r]), used, retain_graph=True, allow_unused=True)
        for r in range(self.world):
            loss_of(r, outs[r]).backward()
        return [tuple(None if o is None else o.detach() for o in out) for out in outs]


def make_inputs(seed, b, l, h, g, p, n, *, z, D, bias, dtype):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    vals = dict(x=r(b, l, h, p), dt=r(b, l, h, scale=0.5) - 1.0, A=-torch.rand(h, generator=gen) - 0.3,
                B=r(b, l, g, n), C=r(b, l, g, n), D=None if D is None else (r(h) if D == "head" else r(h, p)),
                z=r(b, l, h, p) if z else None, dt_bias=r(h, scale=0.3) if bias else None)
    return [None if vals[k] is None else vals[k].to(dtype) if k in HALF else vals[k] for k in NAMES]


def piece(t, rank, world):
    """Rank ``rank``'s piece of a per-token input (dim 1), parameters as they are."""
    if t is None or t.dim() < 3:
        return t
    n = t.shape[1]
    return t.narrow(1, split_start(n, world, rank), split_sizes(n, world)[rank])


def referee_outputs(args, world, limit):
    """Float64 referee: y of the whole sequence and the state after each piece."""
    x, dt, A, B, C, D, z, bias = args
    lo, hi = limit
    y, _ = ssd_referee(x, dt, A, B, C, D, z, bias, None, True, lo, hi)
    finals = []
    for r in range(world):
        end = split_start(x.shape[1], world, r) + split_sizes(x.shape[1], world)[r]
        finals.append(ssd_referee(*[t if t is None or t.dim() < 3 else t[:, :end] for t in args],
                                  None, True, lo, hi)[1])
    return y, finals


F32 = torch.float32


@pytest.mark.interp
@pytest.mark.parametrize("world,l,h,g,chunk,z,D,bias,limit,dtype", [
    (2, 13, 3, 1, 4, True, "head", True, (0.0, math.inf), F32),    # pieces 7, 6: short last chunks
    (3, 11, 3, 3, 4, False, None, False, (0.0, math.inf), F32),    # pieces 4, 4, 3 (< one chunk)
    (3, 14, 5, 1, 4, True, "head_dim", True, (0.05, 1.5), F32),    # odd heads, D per (h, p), dt clamp
    (2, 6, 3, 1, 8, False, "head", False, (0.0, math.inf), F32),   # every piece shorter than a chunk
    (3, 14, 3, 1, 4, True, "head", True, (0.0, math.inf), torch.bfloat16),
    (2, 72, 3, 1, 4, True, "head", True, (0.0, math.inf), F32),    # 9 chunks a piece: the exchange
])                                                                 # kernels' chunk blocks, 8 and 1
def test_matches_float64_whole_sequence(world, l, h, g, chunk, z, D, bias, limit, dtype):
    b, p, n = 2, 4, 8
    args = make_inputs(world * 100 + l, b, l, h, g, p, n, z=z, D=D, bias=bias, dtype=dtype)
    gen = torch.Generator().manual_seed(l + h)
    dy = torch.randn(b, l, h, p, generator=gen).to(dtype)
    dfs = [torch.randn(b, h, p, n, generator=gen) for _ in range(world)]

    ref = [None if a is None else a.double().requires_grad_() for a in args]
    y_ref, finals_ref = referee_outputs(ref, world, limit)
    loss = (y_ref * dy.double()).sum() + sum((f * d.double()).sum() for f, d in zip(finals_ref, dfs))
    loss.backward()

    got = [None if a is None else a.clone().requires_grad_() for a in args]

    def forward(rank, exchange):
        return cp_ssd_fused(*[piece(t, rank, world) for t in got], chunk, True, limit[0], limit[1], exchange)

    def loss_of(rank, out):
        return (out[0] * piece(dy, rank, world)).sum() + (out[1] * dfs[rank]).sum()

    outs = Ranks(world).run(forward, loss_of, got)
    errs = {"y": rel_err(torch.cat([o[0] for o in outs], 1), y_ref)}
    errs.update({f"final{r}": rel_err(o[1], f) for r, (o, f) in enumerate(zip(outs, finals_ref))})
    assert all(o[1].dtype == torch.float32 for o in outs)
    assert torch.cat([o[0] for o in outs], 1).dtype == dtype
    check_grads(errs, NAMES, [None if a is None else a.grad for a in got], got, ref, TOL[dtype])


@pytest.mark.interp
@pytest.mark.parametrize("world,dtype", [(2, F32), (4, torch.bfloat16)])
def test_matches_float64_on_the_state_walk(world, dtype):
    """Pieces that are whole chunks with power-of-two headdim and dstate: the zero-start states come
    from the state walk (the chunk scan's fold form on every rank but the first, the fold forms
    of dx and dB on every rank but the last), as on the GPU at the benchmark's sizes."""
    import mambac.codegen.ssd_kernels as sk
    b, h, p, n, chunk = (2 if world == 2 else 1), 3, 16, 16, 16   # batch offsets: checked at world 2
    l = world * 2 * chunk
    args = make_inputs(7 + world, b, l, h, 1, p, n, z=True, D="head", bias=True, dtype=dtype)
    pr = sk.prepare(*[piece(t, 1, world) for t in args], None, chunk, True, 0.0, math.inf)
    assert sk.forward_path(pr) == "walk" and sk.choose_walk(pr) == "walk"
    gen = torch.Generator().manual_seed(world)
    dy = torch.randn(b, l, h, p, generator=gen).to(dtype)
    dfs = [torch.randn(b, h, p, n, generator=gen) for _ in range(world)]
    ref = [None if a is None else a.double().requires_grad_() for a in args]
    y_ref, finals_ref = referee_outputs(ref, world, (0.0, math.inf))
    loss = (y_ref * dy.double()).sum() + sum((f * d.double()).sum() for f, d in zip(finals_ref, dfs))
    loss.backward()
    got = [None if a is None else a.clone().requires_grad_() for a in args]

    def forward(rank, exchange):
        return cp_ssd_fused(*[piece(t, rank, world) for t in got], chunk, True, 0.0, math.inf, exchange)

    def loss_of(rank, out):
        return (out[0] * piece(dy, rank, world)).sum() + (out[1] * dfs[rank]).sum()

    outs = Ranks(world).run(forward, loss_of, got)
    errs = {"y": rel_err(torch.cat([o[0] for o in outs], 1), y_ref)}
    errs.update({f"final{r}": rel_err(o[1], f) for r, (o, f) in enumerate(zip(outs, finals_ref))})
    check_grads(errs, NAMES, [None if a is None else a.grad for a in got], got, ref, TOL[dtype])


@pytest.mark.interp
@pytest.mark.parametrize("walk", [True, False])
def test_without_the_final_state(walk):
    """``want_final=False`` (what ``split_sequence`` asks for when nothing reads the final state):
    every rank's final state is None, and y and every gradient still match the float64 referee
    (the loss reads y only), on the state walk and on the per-chunk path."""
    world, b, h, chunk = 3, 1, 3, 16
    p, n, l = (16, 16, world * 2 * chunk) if walk else (4, 8, 40)
    args = make_inputs(11, b, l, h, 1, p, n, z=True, D="head", bias=True, dtype=F32)
    dy = torch.randn(b, l, h, p, generator=torch.Generator().manual_seed(3))
    ref = [None if a is None else a.double().requires_grad_() for a in args]
    y_ref, _ = referee_outputs(ref, world, (0.0, math.inf))
    (y_ref * dy.double()).sum().backward()
    got = [None if a is None else a.clone().requires_grad_() for a in args]

    def forward(rank, exchange):
        return cp_ssd_fused(*[piece(t, rank, world) for t in got], chunk, True, 0.0, math.inf, exchange,
                            want_final=False)

    outs = Ranks(world).run(forward, lambda rank, out: (out[0] * piece(dy, rank, world)).sum(), got)
    assert all(o[1] is None for o in outs)
    errs = {"y": rel_err(torch.cat([o[0] for o in outs], 1), y_ref)}
    check_grads(errs, NAMES, [None if a is None else a.grad for a in got], got, ref, TOL[F32])


@pytest.mark.interp
@pytest.mark.parametrize("b,path", [(1, "walk"), (2, "walk"), (2, "three")])
def test_summary_rows_hold_the_total_decays(monkeypatch, b, path):
    """The summary a rank sends is its final state from zero, then each head's total log-decay:
    the walk writes the totals itself (the summary's row stride tells it, one batch row included),
    the per-chunk path sums the chunk totals.  Every ``torch.empty`` is NaN-filled meanwhile, so a
    total left unwritten cannot pass on a stale buffer."""
    import mambac.codegen.ssd_kernels as sk
    from mambac.runtime.cp_ssd_fused import chunk_totals, forward_passes
    args = make_inputs(3, b, 64, 3, 1, 16, 16, z=False, D=None, bias=True, dtype=torch.float32)
    pr = sk.prepare(*args, None, 16, True, 0.0, math.inf)
    monkeypatch.setattr("mambac.runtime.cp_ssd_fused.forward_path", lambda pr: path)
    sent = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(math.nan))
    calls = []
    monkeypatch.setattr(sk, "run_state_walk", lambda *a, run=sk.run_state_walk: calls.append(1) or run(*a))
    y, final, saved, _ = forward_passes(pr, Exchange(gather=lambda t: sent.append(t.clone()) or t.unsqueeze(0),
                                                     rank=0))
    monkeypatch.setattr(torch, "empty", empty)
    assert len(calls) == (path == "walk")
    hpn = 3 * 16 * 16
    assert torch.equal(sent[0][:, :hpn].view(final.shape), final)
    assert torch.allclose(sent[0][:, hpn:], chunk_totals(pr, saved.cs).sum(-1), rtol=1e-6, atol=1e-6)


def _one_rank() -> Exchange:
    return Exchange(gather=lambda t: t.unsqueeze(0), rank=0)


@pytest.mark.interp
def test_cp_ssd_dispatch(monkeypatch):
    """Kernels on and real tensors: ``cp_ssd`` runs the fused form (one rank: the plain scan); fake
    tensors (shape propagation, the memory model): ``FakeCPSSD``, which returns the same shapes and
    saves tensors of the shapes and dtypes the real form saves."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mambac.ops import use_kernels
    from mambac.runtime import context_parallel as cp
    monkeypatch.setattr(cp, "summary_exchange", lambda rank, world, group: _one_rank())
    args = make_inputs(0, 1, 9, 3, 1, 4, 8, z=True, D="head", bias=True, dtype=torch.float32)
    leaves = [None if a is None else a.clone().requires_grad_() for a in args]

    def saved_by(fn):
        seen = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            out = fn()
        return out, sorted(seen, key=str)

    with use_kernels("triton"):
        (y, final), real_saved = saved_by(lambda: cp.cp_ssd(*leaves, 4, True, 0.0, math.inf, 0, 1, "cp"))
        y_ref, final_ref = torch.ops.mambac.ssd(*args, None, 4, True, 0.0, math.inf)
    assert y.grad_fn.name() == "CPSSDFunctionBackward"
    assert rel_err(y, y_ref) == 0.0 and rel_err(final, final_ref) == 0.0
    monkeypatch.setattr("mambac.runtime.cp_ssd_fused.cp_ssd_fused", None)   # must not be reached
    with FakeTensorMode(), use_kernels("triton"):
        fake = [None if a is None else torch.empty(a.shape, dtype=a.dtype).requires_grad_() for a in args]
        (y_fake, final_fake), fake_saved = saved_by(lambda: cp.cp_ssd(*fake, 4, True, 0.0, math.inf, 0, 1, "cp"))
    assert y_fake.grad_fn.name() == "FakeCPSSDBackward"
    assert (y_fake.shape, y_fake.dtype, final_fake.shape, final_fake.dtype) == (y.shape, y.dtype, final.shape,
                                                                               final.dtype)
    assert fake_saved == real_saved and len(real_saved) >= 11


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_float64_gpu(dtype):
    """Two ranks at the benchmark's head sizes (h48 p64 n128 g1, chunk 256; 2 x 600 tokens) on
    CUDA, against the float64 reference op on the whole sequence, gated, with D and dt_bias."""
    world, b, l, h, p, n, q = 2, 2, 1200, 48, 64, 128, 256
    args = [None if a is None else a.cuda() for a in
            make_inputs(1, b, l, h, 1, p, n, z=True, D="head", bias=True, dtype=dtype)]
    gen = torch.Generator(device="cuda").manual_seed(2)
    dy = torch.randn(b, l, h, p, generator=gen, device="cuda").to(dtype)
    df = torch.randn(b, h, p, n, generator=gen, device="cuda")
    ref = [None if a is None else a.double().requires_grad_() for a in args]
    y_ref, f_ref = torch.ops.mambac.ssd(*ref, None, q, True, 0.0, math.inf)
    ((y_ref * dy.double()).sum() + (f_ref * df.double()).sum()).backward()
    got = [None if a is None else a.clone().requires_grad_() for a in args]

    def forward(rank, exchange):
        return cp_ssd_fused(*[piece(t, rank, world) for t in got], q, True, 0.0, math.inf, exchange)

    def loss_of(rank, out):
        return (out[0] * piece(dy, rank, world)).sum() + ((out[1] * df).sum() if rank == world - 1 else 0)

    outs = Ranks(world).run(forward, loss_of, got)
    errs = {"y": rel_err(torch.cat([o[0] for o in outs], 1), y_ref), "final": rel_err(outs[-1][1], f_ref)}
    check_grads(errs, NAMES, [None if a is None else a.grad for a in got], got, ref, TOL[dtype])
