"""The kernel IR for a fused SSD (Mamba-2 chunked scan) region.

A region is what the fusion passes decided around one ``mambac::ssd`` node: which prologue steps
act on dt (bias, softplus, clamp), which epilogue steps act on y (D skip, z gate), whether an
initial state comes in, the dtypes and the chunk size.  Renderers read only this value, so two
calls with equal regions share generated kernels; everything shape-dependent (sizes, strides) is
a runtime argument and tile sizes are a ``TileConfig`` chosen by autotune.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Optional

import torch


def pow2(n: int) -> int:
    """``n`` rounded up to a power of two (Triton ranges and tiles need one; 1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (how many tiles of ``b`` cover ``a``)."""
    return -(-a // b)

# io dtype name -> (torch dtype, Triton dtype expression)
IO_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bf16": (torch.bfloat16, "tl.bfloat16"),
    "fp16": (torch.float16, "tl.float16"),
    "fp32": (torch.float32, "tl.float32"),
}
KERNEL_DTYPES = tuple(td for td, _ in IO_DTYPES.values())  # what generated kernels read and write
D_MODES = ("none", "head", "head_dim")


def io_name(dtype: torch.dtype) -> str:
    """The IR name of a torch dtype usable as the io dtype (raises for others)."""
    for name, (td, _) in IO_DTYPES.items():
        if td == dtype:
            return name
    raise ValueError(f"no generated SSD kernels for dtype {dtype}; supported: bf16, fp16, fp32")


@dataclass(frozen=True)
class SSDRegion:
    """One fused SSD region: prologue, core, epilogue, dtypes, chunk size.

    Invariants: ``d_mode`` is one of ``D_MODES``; ``io_dtype`` is a key of ``IO_DTYPES`` and is
    the dtype of x, B, C and z (and of every matmul operand); state and decay math is fp32.
    """

    has_dt_bias: bool
    dt_softplus: bool
    dt_clamp: bool
    d_mode: str
    has_z: bool
    has_initial_state: bool
    io_dtype: str
    chunk_size: int
    # "auto": ieee for fp32 io, native tensor-core inputs for half types; "tf32"; "ieee";
    # "upcast": half operands are cast to fp32 first (the Triton interpreter multiplies bf16
    # bit patterns as integers, so interpreted half kernels need it; results match fp32 accumulate)
    dot_precision: str = "auto"

    def __post_init__(self) -> None:
        if self.d_mode not in D_MODES:
            raise ValueError(f"d_mode must be one of {D_MODES}, got {self.d_mode!r}")
        if self.io_dtype not in IO_DTYPES:
            raise ValueError(f"io_dtype must be one of {tuple(IO_DTYPES)}, got {self.io_dtype!r}")
        if self.dot_precision not in ("auto", "tf32", "ieee", "upcast"):
            raise ValueError(f"unknown dot_precision {self.dot_precision!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")

    @property
    def tl_io(self) -> str:
        return IO_DTYPES[self.io_dtype][1]

    @property
    def torch_io(self) -> torch.dtype:
        return IO_DTYPES[self.io_dtype][0]

    @property
    def chunk_pow2(self) -> int:
        """The chunk rounded up to a power of two (Triton ranges need one)."""
        return pow2(self.chunk_size)

    def dot_kwargs(self) -> str:
        """Extra keyword text for every ``tl.dot`` in generated code."""
        prec = "ieee" if self.dot_precision == "upcast" else self.dot_precision
        if prec == "auto":
            prec = "ieee" if self.io_dtype == "fp32" else ""
        return f', input_precision="{prec}"' if prec else ""

    def summary(self) -> str:
        """A one-line description for headers of generated files and for error messages."""
        flags = [f for f, on in (("dt_bias", self.has_dt_bias), ("softplus", self.dt_softplus),
                                 ("clamp", self.dt_clamp), ("z", self.has_z),
                                 ("init", self.has_initial_state)) if on]
        return (f"ssd chunk={self.chunk_size} io={self.io_dtype} D={self.d_mode} "
                f"flags=[{','.join(flags)}] dot={self.dot_precision}")


def region_for(x: torch.Tensor, chunk_size: int, *, D: Optional[torch.Tensor], z: Any, dt_bias: Any,
               initial_state: Any, dt_softplus: bool, dt_min: float, dt_max: float,
               dot_precision: str = "auto") -> SSDRegion:
    """The region that an eager ``ssd`` call with these arguments describes."""
    d_mode = "none" if D is None else ("head" if D.dim() == 1 else "head_dim")
    return SSDRegion(
        has_dt_bias=dt_bias is not None, dt_softplus=bool(dt_softplus),
        dt_clamp=(float(dt_min), float(dt_max)) != (0.0, float("inf")), d_mode=d_mode,
        has_z=z is not None, has_initial_state=initial_state is not None,
        io_dtype=io_name(x.dtype), chunk_size=int(chunk_size), dot_precision=dot_precision)


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch shape of one generated kernel (what autotune picks).

    ``heads`` changes the rendered source (heads handled per program, unrolled), and so does
    ``tma`` (tiles loaded through tensor descriptors, where a family offers it); ``block_n`` is a
    third block size, set only by the kernels that tile a third axis (dstate); ``splits`` is how
    many programs share one group's heads (their partial sums are added afterwards); the block
    sizes are constexpr arguments; ``num_warps``, ``num_stages`` and, where set, ``maxnreg`` (a cap
    on registers per thread) are Triton's launch options (``launch_options``).
    """

    block_m: int = 64
    block_k: int = 64
    heads: int = 1
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: Optional[int] = None
    tma: bool = False
    block_n: Optional[int] = None

    def launch_options(self) -> dict[str, int]:
        """Keyword options of the Triton launch (``maxnreg`` only when set)."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg is not None:
            options["maxnreg"] = self.maxnreg
        return options

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        if fields["maxnreg"] is None:  # configs without a cap keep the keys they were stored under
            del fields["maxnreg"]
        if not fields["tma"]:
            del fields["tma"]
        if fields["block_n"] is None:  # only the state walk tiles a third axis
            del fields["block_n"]
        return json.dumps(fields, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "TileConfig":
        return TileConfig(**json.loads(text))
