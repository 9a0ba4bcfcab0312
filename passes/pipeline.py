"""The named, ordered pass lists.  A pipeline is data: the runner looks each name up in ``PASSES``."""
from __future__ import annotations

from mambac.passes.cancel_redundant_comms import cancel_redundant_comms
from mambac.passes.canonicalize import canonicalize
from mambac.passes.eliminate_dead_code import eliminate_dead_code
from mambac.passes.fuse_loss import fuse_loss
from mambac.passes.fuse_ssm import fuse_ssm
from mambac.passes.insert_collectives import insert_collectives
from mambac.passes.plan_remat import plan_remat
from mambac.passes.propagate_sharding import propagate_sharding
from mambac.passes.split_sequence import split_sequence

PASSES = {
    "canonicalize": canonicalize,
    "fuse_ssm": fuse_ssm,
    "fuse_loss": fuse_loss,
    "eliminate_dead_code": eliminate_dead_code,
    "propagate_sharding": propagate_sharding,
    "insert_collectives": insert_collectives,
    "cancel_redundant_comms": cancel_redundant_comms,
    "plan_remat": plan_remat,
    "split_sequence": split_sequence,
}

SINGLE_DEVICE = [
    "canonicalize",          # before fuse_ssm: the fusion patterns match the canonical spellings only
    "fuse_ssm",
    "fuse_loss",             # one rank only: the distributed passes rewrite the loss for a vocab-parallel head
    "eliminate_dead_code",   # after fusions: removes the absorbed elementwise nodes
]
SINGLE_RANK_ONLY = ("fuse_loss",)

DISTRIBUTED = [p for p in SINGLE_DEVICE if p not in SINGLE_RANK_ONLY] + [
    "propagate_sharding",      # on the fused graph: the rules see fused SSM ops, not their prologues
    "insert_collectives",      # realises every placement change; re-propagates local shapes
    "cancel_redundant_comms",  # folds gather+grad-reduce pairs, gather+slice pairs, duplicates
    "eliminate_dead_code",
]


def pipeline_for(options) -> list[str]:
    """The pass list for these compile options (the distributed one for more than one rank)."""
    remat = ["plan_remat"] if getattr(options, "remat", "none") != "none" else []  # last: plans the final graph
    if options is not None and getattr(options, "world_size", 1) > 1:
        # split_sequence after the tp passes: it swaps the (tp-local) sequence ops for their cp forms
        cp = ["split_sequence", "eliminate_dead_code"] if getattr(options, "cp", 1) > 1 else []
        return list(DISTRIBUTED) + cp + remat
    return list(SINGLE_DEVICE) + remat
