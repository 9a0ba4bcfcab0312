"""The bodies of ``torch.utils.checkpoint`` regions, lowered like the graph around them.

Under ``torch.compile`` a checkpointed call reaches the backend as one higher-order node,
``torch.ops.higher_order.tag_activation_checkpoint(body, *operands)``, whose ``body`` is a
sub-graph (``wrap_body_N``) that the passes of the outer graph never visit.  ``lower_regions``
gives each body fake values from dynamo's own (its placeholders' ``example_value``) and runs the
one-rank pass list on it (no recompute planning: the region recomputes already), so the mixers
inside fuse as they would outside.  The body keeps its inputs and outputs, so the higher-order
node, and AOTAutograd's recompute of it in the backward, are unchanged.  A body that does not
lower is left as dynamo traced it, with a warning.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.fx

from mambac.capture import propagate_shapes
from mambac.errors import MambacError
from mambac.passes.context import PassContext

log = logging.getLogger("mambac.backend")


def checkpoint_bodies(gm: torch.fx.GraphModule) -> list[str]:
    """The attribute names of ``gm``'s checkpoint-region bodies, in graph order, each once."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    names: list[str] = []
    for node in gm.graph.nodes:
        if hop is not None and node.op == "call_function" and node.target is hop and node.args:
            body = node.args[0]
            if isinstance(body, torch.fx.Node) and body.op == "get_attr" and body.target not in names:
                if isinstance(getattr(gm, str(body.target), None), torch.fx.GraphModule):
                    names.append(str(body.target))
    return names


def lower_regions(gm: torch.fx.GraphModule, mode, ctx: PassContext) -> set[str]:
    """Run the one-rank passes on every checkpoint body of ``gm`` (in place); their counters are
    added to ``ctx``'s.  Returns the names of the bodies lowered."""
    from mambac.backend import annotate_sources
    from mambac.lowering import make_context
    from mambac.passes.pipeline import SINGLE_DEVICE
    from mambac.passes.runner import run_passes

    lowered: set[str] = set()
    for name in checkpoint_bodies(gm):
        body = getattr(gm, name)
        holders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inputs = [n.meta.get("example_value") for n in holders]
        if any(v is None for v in inputs):
            continue
        sub = make_context(dataclasses.replace(ctx.options, remat="none", memory_budget=None))
        sub.dump_dir = None
        try:
            annotate_sources(body)
            propagate_shapes(body, inputs, mode)
            setattr(gm, name, run_passes(body, sub, list(SINGLE_DEVICE)))
        except MambacError as exc:
            log.warning("mambac backend: the checkpoint region %s runs as dynamo traced it, unfused: %s", name, exc)
            continue
        for pass_name, stats in sub.stats.items():
            for key, n in stats.counts.items():
                ctx.stats_for(pass_name).add(key, n)
        lowered.add(name)
    return lowered
