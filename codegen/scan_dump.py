"""Sources of the scan kernels one op call runs, for ``mambac dump --kernels`` (``codegen/dump.py``).

Each function takes the op's arguments (traced values: only dtypes, shapes and which optional
inputs are present matter) and returns ``(kernel name, region summary, source)`` for every kernel
the forward and the backward launch, rendered exactly as a run renders them.
"""
from __future__ import annotations

from typing import Callable

from mambac.codegen import render_mamba3 as R3
from mambac.codegen import render_mamba3_mimo as RM
from mambac.codegen import render_selective_scan as RS


def selective_scan_sources(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen.selective_scan_kernels import region_of
    u, delta, A, B, C, D, z, delta_bias, init, softplus = args
    r = region_of(u, D, z, delta_bias, init, softplus)
    kernels = ((RS.LOCAL, RS.render_chunk_local), (RS.COMBINE, RS.render_combine), (RS.OUT, RS.render_chunk_out),
               (RS.ADJ_LOCAL, RS.render_adjoint_local), (RS.ADJ_COMBINE, RS.render_adjoint_combine),
               (RS.BWD, RS.render_backward))
    return [(name, r.summary(), render(r)) for name, render in kernels]


def _mamba3(R, r) -> list[tuple[str, str, str]]:
    return [(R.FWD, r.summary(), R.render_forward(r)),
            (R.FWD, r.summary() + " (checkpoints)", R.render_forward(r, with_out=False, checkpoints=True)),
            (R.BWD, r.summary(), R.render_backward(r))]


def mamba3_siso_sources(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen.mamba3_kernels import region_of
    return _mamba3(R3, region_of(args))


def mamba3_mimo_sources(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen.mamba3_mimo_kernels import region_of
    return _mamba3(RM, region_of(args))


SCAN_RENDERERS: dict[str, Callable[[list], list[tuple[str, str, str]]]] = {
    "selective_scan": selective_scan_sources, "mamba3_siso": mamba3_siso_sources,
    "mamba3_mimo": mamba3_mimo_sources,
}
