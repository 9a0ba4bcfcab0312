"""The generated Triton source of every kernel a lowered program uses (``mambac dump --kernels``).

For each mambac op node of the program's graph, the region its arguments describe (flags from the
node's arguments, dtypes and sizes from the traced values) is rendered exactly as a run would
render it, with the first tile candidate for a GPU where the source depends on the tile config.
Equal sources are listed once.  Ops without generated kernels are named, not rendered.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mambac.codegen import cache


@dataclass(frozen=True)
class KernelSource:
    name: str       # kernel (function) name
    op: str         # op name
    nodes: tuple    # graph nodes that use it
    summary: str    # the region, in one line
    source: str

    @property
    def file_name(self) -> str:
        return f"{self.name}-{cache.content_hash(self.source)}.py"


def _value(a: Any) -> Any:
    """The traced value of a node argument (a fake tensor), or the constant itself."""
    if isinstance(a, torch.fx.Node):
        return a.meta.get("val")
    return a


def _family_sources(fams, region, dims) -> list[tuple[str, str, str]]:
    from mambac.codegen.ssd_launch import source_of
    out = []
    for fam in fams:
        cfg = fam.candidates(dims)[0]
        out.append((fam.name, region.summary(), source_of(fam, region, cfg)))
    return out


def _ssd(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen import ssd_kernels as fk, ssd_kernels_bwd as bk
    from mambac.codegen.kernel_ir import region_for
    from mambac.codegen.ssd_launch import Dims
    x, dt, A, B, C, D, z, dt_bias, init, chunk, softplus, lo, hi = args
    chunk = fk.kernel_chunk(chunk)   # the length the kernels run at
    region = region_for(x, chunk, D=D, z=z, dt_bias=dt_bias, initial_state=init, dt_softplus=softplus,
                        dt_min=lo, dt_max=hi)
    b, l, h, p = x.shape
    dims = Dims(b=b, l=l, h=h, g=B.shape[2], p=p, n=B.shape[3], q=int(chunk))
    fams = [fk.CHUNK_STATE, fk.STATE_PASS, fk.CHUNK_SCAN] + ([bk.GATE_BWD] if region.has_z else [])
    fams += [bk.DSTATE, bk.STATE_PASS_BWD, bk.DX, bk.DC, bk.DB, bk.DT_BWD]
    return _family_sources(fams, region, dims)


def _conv(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen import conv_kernels as ck
    x, weight, bias, init, act = args
    dims = ck.ConvDims(x.shape[0], x.shape[1], x.shape[2], weight.shape[1])
    fwd = ck.region_of(weight, bias, init, act)
    bwd = ck.region_of(weight, bias, init, act, dfinal=weight)  # the final state may be used downstream
    return _family_sources([ck.FWD], fwd, dims) + _family_sources([ck.BWD], bwd, dims)


def _gated(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen import norm_kernels as nk
    x, weight, z, eps, group, nbg = args
    region = nk.gated_region(z, group, nbg)
    dims = nk.RowDims(x.numel() // x.shape[-1], x.shape[-1], group)
    return _family_sources([nk.GATED_FWD, nk.GATED_BWD], region, dims)


def _add(args: list) -> list[tuple[str, str, str]]:
    from mambac.codegen import norm_kernels as nk
    from mambac.codegen.conv_norm_ir import AddNormRegion
    from mambac.codegen.kernel_ir import pow2
    x, residual, weight, eps, _ = args
    n = x.shape[-1]
    dims = nk.RowDims(x.numel() // n, n, n)
    fwd = AddNormRegion(has_residual=residual is not None, width_pow2=pow2(n))
    bwd = AddNormRegion(has_residual=residual is not None, width_pow2=pow2(n), has_dout=True, has_dres=True)
    return _family_sources([nk.ADD_FWD], fwd, dims) + _family_sources([nk.ADD_BWD], bwd, dims)


# op name -> sources of the kernels one call with these (traced) arguments runs
RENDERERS: dict[str, Callable[[list], list[tuple[str, str, str]]]] = {
    "ssd": _ssd, "causal_conv1d": _conv, "gated_rmsnorm": _gated, "add_rmsnorm": _add,
}
from mambac.codegen.scan_dump import SCAN_RENDERERS  # noqa: E402  (selective scan, Mamba-3 SISO/MIMO)
RENDERERS.update(SCAN_RENDERERS)


def program_kernels(gm: torch.fx.GraphModule) -> tuple[list[KernelSource], list[str]]:
    """(kernel sources used by ``gm``, names of its mambac ops that have no generated kernels)."""
    from mambac.ops._common import info_for_target
    found: dict[tuple[str, str], KernelSource] = {}
    missing: list[str] = []
    for node in gm.graph.nodes:
        info = info_for_target(node.target) if node.op == "call_function" else None
        if info is None:
            continue
        render = RENDERERS.get(info.name)
        if render is None:
            if info.name not in missing:
                missing.append(info.name)
            continue
        for name, summary, src in render([_value(a) for a in node.args]):
            key = (name, src)
            old = found.get(key)
            nodes = (old.nodes if old else ()) + (node.name,)
            found[key] = KernelSource(name=name, op=info.name, nodes=nodes, summary=summary, source=src)
    return list(found.values()), missing


def format_kernels(kernels: list[KernelSource], missing: list[str]) -> str:
    """All sources, each under a header naming the kernel, its op, region and graph nodes."""
    parts = []
    for k in kernels:
        parts.append(f"# ===== {k.file_name}  (op {k.op}: {k.summary}; nodes {', '.join(k.nodes)})\n{k.source}")
    if missing:
        parts.append(f"# ops without generated kernels (their reference runs): {', '.join(missing)}\n")
    return "\n".join(parts)


def write_kernels(kernels: list[KernelSource], missing: list[str], directory: str | Path) -> list[Path]:
    """Write each source to ``directory/<kernel>-<hash>.py`` plus an ``index.txt``; returns the files."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    files = []
    lines = []
    for k in kernels:
        path = d / k.file_name
        path.write_text(k.source)
        files.append(path)
        lines.append(f"{k.file_name}\top {k.op}\t{k.summary}\tnodes {', '.join(k.nodes)}")
    if missing:
        lines.append("no generated kernels: " + ", ".join(missing))
    (d / "index.txt").write_text("\n".join(lines) + "\n")
    return files


def dump_program_kernels(gm: torch.fx.GraphModule, output: str = "") -> int:
    """``mambac dump MODEL --kernels [-o DIR]``: print the sources, or write them to DIR."""
    import sys
    kernels, missing = program_kernels(gm)
    if output:
        files = write_kernels(kernels, missing, output)
        print(f"wrote {len(files)} kernel sources and index.txt to {output}")
    else:
        sys.stdout.write(format_kernels(kernels, missing))
    return 0
