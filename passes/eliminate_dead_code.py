"""``eliminate_dead_code``: remove nodes whose values nobody uses.

Needs: nothing.  Guarantees: the same outputs; every removed node counted in
``ctx.stats['eliminate_dead_code']['removed']``.  mambac ops are functional (``mutates_args=()``),
so an unused op (a final state nobody reads) is removed like any other pure node; placeholders
stay, so the forward signature never changes.
"""
from __future__ import annotations

import torch.fx

from mambac.passes.context import PassContext

NAME = "eliminate_dead_code"


def eliminate_dead_code(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    ctx.stats_for(NAME).add("removed", before - len(gm.graph.nodes))
    gm.recompile()
    return gm
