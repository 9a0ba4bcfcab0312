"""Kernel IR of the elementwise-and-reduction ops: causal conv1d, gated RMSNorm, add + RMSNorm.

Like ``SSDRegion``, a region holds exactly what changes the generated source (the op's flags and
the compile-time sizes that Triton ranges need); every other size and every stride is a runtime
argument, and dtypes follow the pointers (stores cast to the destination's element type).  The one
thing about strides a region records is their alignment (``stride_hints``), which decides whether
the loads can be vectorised.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

Hints = tuple[tuple[str, int], ...]


def stride_hints(**strides: int) -> Hints:
    """Stride arguments that are multiples of 2, 4 or 8 elements (but not of 16), as
    ``((name, multiple), ...)``.  Triton proves alignment only for integers divisible by 16, so
    a row stride of 3352 (a slice of the Mamba-2 in_proj output) left it issuing one 2-byte load
    per element; ``tl.multiple_of`` on these arguments lets it use 16-byte vector loads again.
    Strides of 1 (specialised by Triton itself) and odd strides get no hint."""
    out = []
    for name, value in strides.items():
        m = math.gcd(abs(int(value)), 16)
        if value != 1 and m in (2, 4, 8):
            out.append((name, m))
    return tuple(out)


def hint_text(hints: Hints) -> str:
    """Summary text of the hints (empty when there are none)."""
    return f" align=[{','.join(f'{n}%{m}' for n, m in hints)}]" if hints else ""


@dataclass(frozen=True)
class ConvRegion:
    """``mambac::causal_conv1d``: width (taps, unrolled), bias, SiLU, initial state, final-state
    gradient (backward only)."""

    width: int
    has_bias: bool
    silu: bool
    has_initial_state: bool
    has_dfinal: bool = False
    hints: Hints = ()

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be positive, got {self.width}")

    def summary(self) -> str:
        flags = [f for f, on in (("bias", self.has_bias), ("silu", self.silu),
                                 ("init", self.has_initial_state), ("dfinal", self.has_dfinal)) if on]
        return f"causal_conv1d width={self.width} flags=[{','.join(flags)}]{hint_text(self.hints)}"


@dataclass(frozen=True)
class GatedNormRegion:
    """``mambac::gated_rmsnorm``: gate z (before or after the norm), group size (padded to a
    power of two for the tile)."""

    has_z: bool
    norm_before_gate: bool
    group_pow2: int
    hints: Hints = ()

    def summary(self) -> str:
        gate = "none" if not self.has_z else ("after_norm" if self.norm_before_gate else "before_norm")
        return f"gated_rmsnorm gate={gate} group<={self.group_pow2}{hint_text(self.hints)}"


@dataclass(frozen=True)
class AddNormRegion:
    """``mambac::add_rmsnorm``: residual present, row width padded to a power of two; in the
    backward, which output gradients arrive."""

    has_residual: bool
    width_pow2: int
    has_dout: bool = False
    has_dres: bool = False
    hints: Hints = ()

    def summary(self) -> str:
        flags = [f for f, on in (("residual", self.has_residual), ("dout", self.has_dout),
                                 ("dres", self.has_dres)) if on]
        return f"add_rmsnorm width<={self.width_pow2} flags=[{','.join(flags)}]{hint_text(self.hints)}"
