"""The pass runner: runs a named pipeline and owns the cross-cutting work around every pass —
timing, verification (``MAMBAC_VERIFY``), dumps (``MAMBAC_DUMP_DIR``), disabling by name
(``MAMBAC_DISABLE_PASSES``) and keeping every intermediate graph's text for ``mambac dump``."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence

import torch.fx

from mambac.errors import MambacError, MambacPassError
from mambac.ir import KERNELS
from mambac.printer import print_graph, to_dot
from mambac.progress import progress
from mambac.verifier import verify
from mambac.passes.context import PassContext
from mambac.passes.pipeline import PASSES

log = logging.getLogger("mambac.passes")


def _dump(ctx: PassContext, index: int, name: str, text: str) -> None:
    if not ctx.dump_dir:
        return
    folder = Path(ctx.dump_dir) / f"rank{ctx.rank}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{index:02d}_{name}.txt").write_text(text)


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, names: Sequence[str]) -> torch.fx.GraphModule:
    """Run the passes ``names`` in order on ``gm``; returns the lowered graph."""
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise MambacPassError(f"unknown passes {unknown}; known: {sorted(PASSES)}")
    gm.meta.setdefault(KERNELS, getattr(ctx.options, "kernels", "auto"))  # what the program runs with
    text = print_graph(gm, "capture", ctx.rank, ctx.world_size)
    ctx.history.append(("capture", text))
    ctx.dot_history.append(("capture", to_dot(gm, "capture")))
    _dump(ctx, 0, "capture", text)
    if ctx.verify:
        verify(gm, "capture")
    for i, name in progress(list(enumerate(names, 1)), f"mambac: lowering rank {ctx.rank}"):
        if name in ctx.disabled:
            log.info("pass %s disabled", name)
            continue
        t0 = time.perf_counter()
        try:
            gm = PASSES[name](gm, ctx)
        except MambacError:
            raise
        except Exception as exc:
            raise MambacPassError(f"pass '{name}' failed on rank {ctx.rank}: {type(exc).__name__}: {exc}") from exc
        ctx.timings[name] = time.perf_counter() - t0
        if ctx.verify:
            verify(gm, name)
        text = print_graph(gm, name, ctx.rank, ctx.world_size)
        ctx.history.append((name, text))
        ctx.dot_history.append((name, to_dot(gm, name)))
        _dump(ctx, i, name, text)
        log.info("pass %s: %.1f ms %s", name, 1e3 * ctx.timings[name], ctx.stats.get(name, None))
    return gm
