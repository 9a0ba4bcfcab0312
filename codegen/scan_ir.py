"""Kernel IR of the recurrent scans: Mamba-1 selective scan and Mamba-3 SISO.

A region records what the generated source is specialised to: which optional inputs exist
(each one adds or removes arguments and statements), the prologue/epilogue flags, the io dtype
and the chunk length.  Sizes and strides stay runtime arguments, tile sizes come from autotune,
so equal regions share one generated kernel per tile config.

The scans keep their state in fp32 registers and walk the sequence step by step inside chunks
of ``chunk`` steps; the state entering every chunk is a checkpoint from which the backward
recomputes that chunk's states (into a scratch buffer) before running the adjoint recurrence
over them.  See docs/codegen_scans.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from mambac.codegen.kernel_ir import IO_DTYPES, io_name


@dataclass(frozen=True)
class ScanRegion:
    """Common fields: ``io_dtype`` is the dtype of the main input (output dtype), ``chunk`` the
    steps per checkpoint interval, ``round_bf16`` emulates round-to-nearest-even bf16 stores (the
    Triton interpreter's casts truncate).

    A subclass names its op (``KIND``) and its flags in summary order (``FLAGS``: summary label,
    field name)."""

    io_dtype: str
    chunk: int
    round_bf16: bool

    KIND: ClassVar[str] = ""
    FLAGS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __post_init__(self) -> None:
        if self.io_dtype not in IO_DTYPES:
            raise ValueError(f"io_dtype must be one of {tuple(IO_DTYPES)}, got {self.io_dtype!r}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be positive, got {self.chunk}")

    def _sizes(self) -> str:
        """The compile-time sizes, as the summary lists them."""
        return f"chunk={self.chunk} io={self.io_dtype}"

    def summary(self) -> str:
        flags = ",".join(label for label, field in self.FLAGS if getattr(self, field))
        return f"{self.KIND} {self._sizes()} flags=[{flags}]"


@dataclass(frozen=True)
class SelectiveScanRegion(ScanRegion):
    """One ``mambac::selective_scan`` call: delta prologue (bias, softplus), D skip, z gate,
    initial state."""

    has_delta_bias: bool = False
    delta_softplus: bool = False
    has_D: bool = False
    has_z: bool = False
    has_init: bool = False

    KIND: ClassVar[str] = "selective_scan"
    FLAGS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("delta_bias", "has_delta_bias"), ("softplus", "delta_softplus"), ("D", "has_D"), ("z", "has_z"),
        ("init", "has_init"))


@dataclass(frozen=True)
class Mamba3Region(ScanRegion):
    """What every Mamba-3 scan call (SISO or MIMO) may have: B/C biases, D skip, z gate, and which
    parts of the carried state (angle, ssm, k, v) come in."""

    has_B_bias: bool = False
    has_C_bias: bool = False
    has_D: bool = False
    has_z: bool = False
    init_angle: bool = False
    init_ssm: bool = False
    init_k: bool = False
    init_v: bool = False


# the incoming state parts, the last flags of both Mamba-3 summaries
_INITS = (("init_angle", "init_angle"), ("init_ssm", "init_ssm"), ("init_k", "init_k"), ("init_v", "init_v"))


@dataclass(frozen=True)
class Mamba3SisoRegion(Mamba3Region):
    """One ``mambac::mamba3_siso`` call."""

    KIND: ClassVar[str] = "mamba3_siso"
    FLAGS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("B_bias", "has_B_bias"), ("C_bias", "has_C_bias"), ("D", "has_D"), ("z", "has_z")) + _INITS


def io_of(t: torch.Tensor) -> str:
    return io_name(t.dtype)


@dataclass(frozen=True)
class Mamba3MimoRegion(Mamba3Region):
    """One ``mambac::mamba3_mimo`` call: the rank (unrolled in the source) and the optional output
    fold (mimo_o); with z the gate is per rank (mimo_z)."""

    rank: int = 1
    has_mimo_o: bool = False

    KIND: ClassVar[str] = "mamba3_mimo"
    FLAGS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("B_bias", "has_B_bias"), ("C_bias", "has_C_bias"), ("z", "has_z"), ("mimo_o", "has_mimo_o"),
        ("D", "has_D")) + _INITS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rank < 1:
            raise ValueError(f"rank must be positive, got {self.rank}")

    def _sizes(self) -> str:
        return f"rank={self.rank} {super()._sizes()}"
