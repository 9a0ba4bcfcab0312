"""``eliminate_dead_code``: remove nodes whose values nobody uses.

Needs: nothing.  Guarantees: the same outputs; every removed node counted in
``ctx.stats['eliminate_dead_code']['removed']``.  mambac ops are functional (``mutates_args=()``),
so an unused op (a final state nobody reads) is removed like any other pure node; placeholders
stay, so the forward signature never changes.  Calls that change interpreter state and return
nothing anyone reads stay too: FX's own impure list, plus what dynamo records around regions it
traced inside (grad mode and autocast switches, and functorch's ``vmap``/``grad`` level
counters, whose loss would leave a batched tensor outside its ``vmap`` at run time).
"""
from __future__ import annotations

import torch.fx
import torch.fx.node

from mambac.passes.context import PassContext

NAME = "eliminate_dead_code"

_STATEFUL_MODULES = ("torch._functorch.predispatch", "torch._C._functorch", "torch._functorch.vmap")
_PRESERVED = frozenset(getattr(torch.fx.node, "_side_effectful_need_to_be_preserved_pre_dispatch", ()))


def _is_stateful(node: torch.fx.Node) -> bool:
    """Whether ``node`` must stay even when nothing reads its value."""
    if node.is_impure():
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in _PRESERVED:
        return True
    name = getattr(target, "__name__", "")
    module = getattr(target, "__module__", "") or ""
    return module.startswith(_STATEFUL_MODULES) and ("nesting" in name or "level" in name) \
        or name in ("_set_grad_enabled", "_enter_autocast", "_exit_autocast")


def eliminate_dead_code(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code(is_impure_node=_is_stateful)
    ctx.stats_for(NAME).add("removed", before - len(gm.graph.nodes))
    gm.recompile()
    return gm
