"""Arguments and checks of the scan ops (selective scan, Mamba-3 SISO and MIMO) shared by their kernel
tests and ``benchmarks/bench_scans.py``.

* ``mamba3_inputs`` / ``check_mamba3``: seeded inputs of the interpreter tests and the comparison of
  the generated Mamba-3 kernels with the float64 step-by-step referee.
* ``SCAN_ARGS`` / ``scan_errors``: random arguments at model-like shapes (torch's global generator)
  and the relative errors of the kernels against a float64 run of the op's own reference, for the
  GPU tier and the benchmark.

Imports only torch and the tests' own helpers, so the benchmark can use it without mambac installed.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from tests.helpers import rel_err

TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}
MAMBA3_OUTS = ("y", "final_angle", "final_ssm", "final_k", "final_v")
_MAMBA3_HALF = ("x", "B", "C", "z")  # the arguments in the io dtype; the others stay fp32


def mamba3_inputs(names: Sequence[str], seed: int, b: int, l: int, h: int, p: int, n: int, g: int, s: int,
                  rank: Optional[int] = None, *, bias=False, z=False, fold=False, D=False, init=False,
                  dtype=torch.float32) -> list:
    """Arguments ``names`` of mamba3_siso (``rank`` None) or mamba3_mimo (per-rank B, C, biases,
    keys and the mimo_x/z/o weights; ``fold``: with mimo_o), drawn in one fixed order."""
    gen = torch.Generator().manual_seed(seed)

    def rn(*shape):
        return torch.randn(*shape, generator=gen)

    keys = () if rank is None else (rank,)
    dt = F.softplus(rn(b, l, h) - 1.0)
    vals = {"x": rn(b, l, h, p), "B": rn(b, l, *keys, g, n), "C": rn(b, l, *keys, g, n), "dt": dt,
            "adt": -dt * (torch.rand(h, generator=gen) + 0.5), "trap": rn(b, l, h), "angles": rn(b, l, h, s),
            "B_bias": rn(h, *keys, n) * 0.3 if bias else None, "C_bias": rn(h, *keys, n) * 0.3 if bias else None}
    if rank is not None:
        vals.update({"mimo_x": rn(h, rank, p), "mimo_z": rn(h, rank, p) if z else None,
                     "mimo_o": rn(h, rank, p) if fold else None})
    vals.update({"D": rn(h) if D else None, "z": rn(b, l, h, p) if z else None,
                 "initial_angle": rn(b, h, s) if init else None, "initial_ssm": rn(b, h, p, n) if init else None,
                 "initial_k": rn(b, *keys, h, n) if init else None, "initial_v": rn(b, h, p) if init else None})
    return [vals[k].to(dtype) if k in _MAMBA3_HALF and vals[k] is not None else vals[k] for k in names]


def check_mamba3(names: Sequence[str], args: list, referee: Callable, forward: Callable, backward: Callable,
                 op_chunk: int, chunk: int, seed: int = 0) -> None:
    """The kernels' outputs and every input gradient (``backward`` given random output gradients)
    against ``referee`` in float64, within ``TOL``; ``op_chunk`` is the op's own chunk_size argument,
    ``chunk`` the kernels' checkpoint interval."""
    from tests.codegen.referee import check_grads
    dtype = args[0].dtype
    ref_in = [None if a is None else a.double().requires_grad_(True) for a in args]
    refs = referee(*ref_in)
    gen = torch.Generator().manual_seed(seed + 1)
    gouts = [torch.randn(o.shape, generator=gen).to(dtype if i == 0 else torch.float32)
             for i, o in enumerate(refs)]
    sum((o * g.double()).sum() for o, g in zip(refs, gouts)).backward()
    outs = forward(*args, op_chunk, chunk=chunk)
    assert outs[0].dtype == dtype and all(o.dtype == torch.float32 for o in outs[1:])
    errs = {name: rel_err(o, ref) for name, o, ref in zip(MAMBA3_OUTS, outs, refs)}
    grads = backward(list(args) + [op_chunk], gouts, chunk=chunk)
    assert len(grads) == len(names) + 1 and grads[-1] is None
    check_grads(errs, names, grads, args, ref_in, TOL[dtype])


def count_calls(monkeypatch, module, names: Sequence[str], chunk: int) -> list[str]:
    """Wrap the functions ``names`` of ``module`` to record each call (by name) and run with ``chunk``."""
    calls: list[str] = []
    for fn in names:
        orig = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _o=orig, _n=fn: calls.append(_n) or _o(*a, chunk=chunk))
    return calls


def assert_grads_match(names: Sequence[str], leaves: Sequence, refs: Sequence, tol: float = 1e-4) -> None:
    """Every present input's gradient within ``tol`` (relative) of the reference's."""
    for name, a, r in zip(names, leaves, refs):
        if a is not None:
            assert rel_err(a.grad, r.grad) < tol, name


# ---- model-like shapes, torch's global generator (GPU tier, benchmark) ---------------------------------

def selective_scan_args(b, d, l, n, g, dtype, device="cuda") -> list:
    """g = 0: B and C shared by all channels; softplus on."""
    bc = (b, n, l) if g == 0 else (b, g, n, l)
    a = [torch.randn(b, d, l), torch.randn(b, d, l) * 0.5 - 1.0, -torch.rand(d, n) - 0.3, torch.randn(*bc),
         torch.randn(*bc), torch.randn(d), torch.randn(b, d, l), torch.randn(d) * 0.3, torch.randn(b, d, n)]
    return [t.to(device, dtype if i in (0, 1, 3, 4, 6) else torch.float32) for i, t in enumerate(a)] + [True]


def mamba3_siso_args(b, l, h, p, n, g, s, dtype, device="cuda") -> list:
    dt = F.softplus(torch.randn(b, l, h) - 1.0)
    a = [torch.randn(b, l, h, p), torch.randn(b, l, g, n), torch.randn(b, l, g, n), dt, -dt * (torch.rand(h) + 0.5),
         torch.randn(b, l, h), torch.randn(b, l, h, s), torch.randn(h, n) * 0.3, torch.randn(h, n) * 0.3,
         torch.randn(h), torch.randn(b, l, h, p), torch.randn(b, h, s), torch.randn(b, h, p, n),
         torch.randn(b, h, n), torch.randn(b, h, p)]
    return [t.to(device, dtype if i in (0, 1, 2, 10) else torch.float32) for i, t in enumerate(a)] + [64]


def mamba3_mimo_args(b, l, h, p, n, g, s, r, dtype, device="cuda") -> list:
    dt = F.softplus(torch.randn(b, l, h) - 1.0)
    a = [torch.randn(b, l, h, p), torch.randn(b, l, r, g, n), torch.randn(b, l, r, g, n), dt,
         -dt * (torch.rand(h) + 0.5), torch.randn(b, l, h), torch.randn(b, l, h, s), torch.randn(h, r, n) * 0.3,
         torch.randn(h, r, n) * 0.3, torch.randn(h, r, p), torch.randn(h, r, p), torch.randn(h, r, p),
         torch.randn(h), torch.randn(b, l, h, p), torch.randn(b, h, s), torch.randn(b, h, p, n),
         torch.randn(b, r, h, n), torch.randn(b, h, p)]
    return [t.to(device, dtype if i in (0, 1, 2, 13) else torch.float32) for i, t in enumerate(a)] + [16]


# op -> (module of mambac.codegen with its kernels, argument maker); the kernels are {op}_forward/_backward
SCAN_OPS = {"selective_scan": ("selective_scan_kernels", selective_scan_args),
            "mamba3_siso": ("mamba3_kernels", mamba3_siso_args),
            "mamba3_mimo": ("mamba3_mimo_kernels", mamba3_mimo_args)}


def scan_errors(args: list, reference: Callable, forward: Callable, backward: Callable) -> dict[str, float]:
    """Relative errors of the kernels' outputs (``out<k>``) and input gradients (``d<index>``)
    against ``reference`` run in float64, for random output gradients."""
    dtype = args[0].dtype
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    ref_in = [a.double().requires_grad_(True) if i in pos else a for i, a in enumerate(args)]
    refs = reference(*ref_in)
    gouts = [torch.randn_like(o, dtype=dtype if k == 0 else torch.float32) for k, o in enumerate(refs)]
    sum((o * g.double()).sum() for o, g in zip(refs, gouts)).backward()
    errs = {f"out{k}": rel_err(o, r) for k, (o, r) in enumerate(zip(forward(*args), refs))}
    grads = backward(args, gouts, [True] * len(args))
    errs.update({f"d{i}": rel_err(grads[i], ref_in[i].grad) for i in pos})
    return errs
