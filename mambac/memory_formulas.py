"""Formulas in the batch size ``B`` and sequence length ``L``: every storage's bytes and every
node's FLOPs fitted exactly by ``a + b*B + c*L + d*B*L`` over fake runs at (2B, L), (B, 2L),
(2B, 2L) and checked at (3B, 3L); what is not bilinear gets ``None``.  Part of ``mambac.memory``
(docs/memory.md)."""
from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

import sympy
import torch

from mambac.memory_record import run_saved

if TYPE_CHECKING:
    from mambac.memory_model import MemoryModel

B, L = sympy.symbols("B L", positive=True, integer=True)


def _bilinear(v00: int, v10: int, v01: int, v11: int, b: tuple[int, int], l: tuple[int, int]):
    d = Fraction(v11 - v10 - v01 + v00, (b[1] - b[0]) * (l[1] - l[0]))
    cb = Fraction(v10 - v00, b[1] - b[0]) - d * l[0]
    cl = Fraction(v01 - v00, l[1] - l[0]) - d * b[0]
    c0 = v00 - cb * b[0] - cl * l[0] - d * b[0] * l[0]
    return c0, cb, cl, d


def _as_expr(coef) -> sympy.Expr:
    c0, cb, cl, d = (sympy.Rational(c.numerator, c.denominator) for c in coef)
    return c0 + cb * B + cl * L + d * B * L


def fit_formulas(model: MemoryModel) -> dict[str, sympy.Expr | None]:
    """Fit every storage's bytes and every node's FLOPs over fake runs at four more shapes."""
    b0, l0 = model.example
    if model.graph is None or not b0 or not l0:
        return {}
    pts = [(2 * b0, l0), (b0, 2 * l0), (2 * b0, 2 * l0), (3 * b0, 3 * l0)]
    dev, dtype = model.autocast
    try:
        with torch.autocast(dev, dtype=dtype, enabled=dtype is not None):
            runs = [model.run] + [run_saved(model.graph, p) for p in pts]
    except Exception:  # a graph specialised to its example shape: no formulas, numbers still exact
        return {}
    series = {k: [r.storages[k].nbytes if k in r.storages else None for r in runs] for k in model.storages}
    series.update({f"flops:{n}": [r.costs[n].flops if n in r.costs else None for r in runs] for n in model.run.costs})
    out: dict[str, sympy.Expr | None] = {}
    for key, vals in series.items():
        if any(v is None for v in vals):
            out[key] = None
            continue
        coef = _bilinear(vals[0], vals[1], vals[2], vals[3], (b0, 2 * b0), (l0, 2 * l0))
        c0, cb, cl, d = coef
        exact = c0 + cb * 3 * b0 + cl * 3 * l0 + d * 9 * b0 * l0 == vals[4]
        out[key] = _as_expr(coef) if exact else None
    return out
