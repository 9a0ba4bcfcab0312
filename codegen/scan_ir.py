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

import torch

from mambac.codegen.kernel_ir import IO_DTYPES, io_name


@dataclass(frozen=True)
class ScanRegion:
    """Common fields: ``io_dtype`` is the dtype of the main input (output dtype), ``chunk`` the
    steps per checkpoint interval, ``round_bf16`` emulates round-to-nearest-even bf16 stores (the
    Triton interpreter's casts truncate)."""

    io_dtype: str
    chunk: int
    round_bf16: bool

    def _check(self) -> None:
        if self.io_dtype not in IO_DTYPES:
            raise ValueError(f"io_dtype must be one of {tuple(IO_DTYPES)}, got {self.io_dtype!r}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be positive, got {self.chunk}")

    def _flags(self, pairs) -> str:
        return ",".join(name for name, on in pairs if on)


@dataclass(frozen=True)
class SelectiveScanRegion(ScanRegion):
    """One ``mambac::selective_scan`` call: delta prologue (bias, softplus), D skip, z gate,
    initial state."""

    has_delta_bias: bool = False
    delta_softplus: bool = False
    has_D: bool = False
    has_z: bool = False
    has_init: bool = False

    def __post_init__(self) -> None:
        self._check()

    def summary(self) -> str:
        flags = self._flags((("delta_bias", self.has_delta_bias), ("softplus", self.delta_softplus),
                             ("D", self.has_D), ("z", self.has_z), ("init", self.has_init)))
        return f"selective_scan chunk={self.chunk} io={self.io_dtype} flags=[{flags}]"


@dataclass(frozen=True)
class Mamba3SisoRegion(ScanRegion):
    """One ``mambac::mamba3_siso`` call: B/C biases, D skip, z gate, and which parts of the
    carried state (angle, ssm, k, v) come in."""

    has_B_bias: bool = False
    has_C_bias: bool = False
    has_D: bool = False
    has_z: bool = False
    init_angle: bool = False
    init_ssm: bool = False
    init_k: bool = False
    init_v: bool = False

    def __post_init__(self) -> None:
        self._check()

    def summary(self) -> str:
        flags = self._flags((("B_bias", self.has_B_bias), ("C_bias", self.has_C_bias), ("D", self.has_D),
                             ("z", self.has_z), ("init_angle", self.init_angle),
                             ("init_ssm", self.init_ssm), ("init_k", self.init_k),
                             ("init_v", self.init_v)))
        return f"mamba3_siso chunk={self.chunk} io={self.io_dtype} flags=[{flags}]"


def io_of(t: torch.Tensor) -> str:
    return io_name(t.dtype)


@dataclass(frozen=True)
class Mamba3MimoRegion(ScanRegion):
    """One ``mambac::mamba3_mimo`` call: the rank (unrolled in the source), B/C biases, the
    optional per-rank gate (mimo_z with z) and output fold (mimo_o), D skip, incoming state parts."""

    rank: int = 1
    has_B_bias: bool = False
    has_C_bias: bool = False
    has_z: bool = False
    has_mimo_o: bool = False
    has_D: bool = False
    init_angle: bool = False
    init_ssm: bool = False
    init_k: bool = False
    init_v: bool = False

    def __post_init__(self) -> None:
        self._check()
        if self.rank < 1:
            raise ValueError(f"rank must be positive, got {self.rank}")

    def summary(self) -> str:
        flags = self._flags((("B_bias", self.has_B_bias), ("C_bias", self.has_C_bias), ("z", self.has_z),
                             ("mimo_o", self.has_mimo_o), ("D", self.has_D), ("init_angle", self.init_angle),
                             ("init_ssm", self.init_ssm), ("init_k", self.init_k), ("init_v", self.init_v)))
        return f"mamba3_mimo rank={self.rank} chunk={self.chunk} io={self.io_dtype} flags=[{flags}]"
