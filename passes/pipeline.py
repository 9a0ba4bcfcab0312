"""The named, ordered pass lists.  A pipeline is data: the runner looks each name up in ``PASSES``."""
from __future__ import annotations

from mambac.passes.canonicalize import canonicalize
from mambac.passes.eliminate_dead_code import eliminate_dead_code
from mambac.passes.fuse_ssm import fuse_ssm

PASSES = {
    "canonicalize": canonicalize,
    "fuse_ssm": fuse_ssm,
    "eliminate_dead_code": eliminate_dead_code,
}

SINGLE_DEVICE = [
    "canonicalize",          # before fuse_ssm: the fusion patterns match the canonical spellings only
    "fuse_ssm",
    "eliminate_dead_code",   # after fusions: removes the absorbed elementwise nodes
]


def pipeline_for(options) -> list[str]:
    """The pass list for these compile options."""
    return list(SINGLE_DEVICE)
