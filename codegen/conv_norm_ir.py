"""Kernel IR of the elementwise-and-reduction ops: causal conv1d, gated RMSNorm, add + RMSNorm.

Like ``SSDRegion``, a region holds exactly what changes the generated source (the op's flags and
the compile-time sizes that Triton ranges need); every other size and every stride is a runtime
argument, and dtypes follow the pointers (stores cast to the destination's element type).
"""
from __future__ import annotations

from dataclasses import dataclass


def pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class ConvRegion:
    """``mambac::causal_conv1d``: width (taps, unrolled), bias, SiLU, initial state, final-state
    gradient (backward only)."""

    width: int
    has_bias: bool
    silu: bool
    has_initial_state: bool
    has_dfinal: bool = False

    def __post_init__(self) -> None:
        if self.width < 1:
            raise ValueError(f"width must be positive, got {self.width}")

    def summary(self) -> str:
        flags = [f for f, on in (("bias", self.has_bias), ("silu", self.silu),
                                 ("init", self.has_initial_state), ("dfinal", self.has_dfinal)) if on]
        return f"causal_conv1d width={self.width} flags=[{','.join(flags)}]"


@dataclass(frozen=True)
class GatedNormRegion:
    """``mambac::gated_rmsnorm``: gate z (before or after the norm), group size (padded to a
    power of two for the tile)."""

    has_z: bool
    norm_before_gate: bool
    group_pow2: int

    def summary(self) -> str:
        gate = "none" if not self.has_z else ("after_norm" if self.norm_before_gate else "before_norm")
        return f"gated_rmsnorm gate={gate} group<={self.group_pow2}"


@dataclass(frozen=True)
class AddNormRegion:
    """``mambac::add_rmsnorm``: residual present, row width padded to a power of two; in the
    backward, which output gradients arrive."""

    has_residual: bool
    width_pow2: int
    has_dout: bool = False
    has_dres: bool = False

    def summary(self) -> str:
        flags = [f for f, on in (("residual", self.has_residual), ("dout", self.has_dout),
                                 ("dres", self.has_dres)) if on]
        return f"add_rmsnorm width<={self.width_pow2} flags=[{','.join(flags)}]"
