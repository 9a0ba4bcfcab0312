"""Numerical helpers shared by the tests: relative errors and forward+backward comparison
against a float64 referee on fresh random inputs."""
from __future__ import annotations

from typing import Callable, Sequence

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero); NaN anywhere fails loudly."""
    a64, b64 = a.detach().double(), b.detach().double()
    assert torch.isfinite(a64).all(), "non-finite values in the result"
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num if den == 0 else num / den


def worst_grad_err(out: torch.Tensor, ref_out: torch.Tensor, cot: torch.Tensor, params, ref_params) -> float:
    """The largest relative error over parameters between the gradients of ``(out * cot).sum()``
    and of ``(ref_out * cot).sum()`` (``cot`` float64; both outputs compared in float64)."""
    got = torch.autograd.grad((out.double() * cot).sum(), list(params))
    want = torch.autograd.grad((ref_out.double() * cot).sum(), list(ref_params))
    return max(rel_err(a, b) for a, b in zip(got, want))


def assert_in_order(src: str, *parts: str) -> None:
    """Each part occurs in ``src``, after the previous one (ordered checks of generated source)."""
    at = 0
    for p in parts:
        i = src.find(p, at)
        assert i >= 0, f"{p!r} not found after offset {at} in:\n{src}"
        at = i + len(p)


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def compare_fwd_bwd(fn: Callable, referee: Callable, inputs: Sequence, *, dtype=torch.float32,
                    tol: float = 1e-5, seed: int = 0, grad_of: Sequence[int] | None = None) -> dict:
    """Run ``fn`` on ``inputs`` cast to ``dtype`` and ``referee`` on float64 copies; compare every
    output and the gradient of every floating input (or those in ``grad_of``) under a random
    cotangent.  Returns the errors; asserts each is below ``tol``."""
    gen = torch.Generator().manual_seed(seed)
    idx = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if grad_of is not None:
        idx = [i for i in idx if i in grad_of]

    def prep(dt):
        out = []
        for i, t in enumerate(inputs):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t = t.detach().to(dt).requires_grad_(i in idx)
            out.append(t)
        return out

    lo, hi = prep(dtype), prep(torch.float64)
    out_lo, out_hi = _as_tuple(fn(*lo)), _as_tuple(referee(*hi))
    assert len(out_lo) == len(out_hi)
    errs = {}
    cots = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in out_hi]
    for k, (a, b) in enumerate(zip(out_lo, out_hi)):
        errs[f"out{k}"] = rel_err(a, b)
    loss_lo = sum((o.double() * c).sum() for o, c in zip(out_lo, cots) if o.requires_grad)
    loss_hi = sum((o * c).sum() for o, c in zip(out_hi, cots) if o.requires_grad)
    if idx:
        g_lo = torch.autograd.grad(loss_lo, [lo[i] for i in idx], allow_unused=True)
        g_hi = torch.autograd.grad(loss_hi, [hi[i] for i in idx], allow_unused=True)
        for i, a, b in zip(idx, g_lo, g_hi):
            a = torch.zeros_like(hi[i]) if a is None else a
            b = torch.zeros_like(hi[i]) if b is None else b
            errs[f"grad{i}"] = rel_err(a, b)
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"
    return errs
