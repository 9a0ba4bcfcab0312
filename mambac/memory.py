"""The memory model: what autograd keeps from the forward pass for the backward pass, node by node,
as exact bytes at the example shape and as formulas in the batch size ``B`` and sequence length
``L``, plus what each node would cost to recompute.  docs/memory.md explains it at length.

Saved tensors are found by asking autograd: the lowered graph runs on fake tensors with grad on and
a ``saved_tensors_hooks`` pack hook, so what counts is exactly what PyTorch saves (custom ops their
tensor inputs, linears input and weight, ``exp`` its result, ...), under autocast too.  They are
grouped by storage (a view keeps its base alive) and attributed to the node that allocated the
storage (or, for a temporary made inside a node, to that node); parameters and graph inputs are
left out.  On a rank of several the graph is the rank's, with its local (sharded) shapes, so the
bytes are per rank.

The parts, one file each: ``memory_record`` (the fake run and ``measure_saved`` on a real one),
``memory_costs`` (FLOPs and bytes per node, the ``Machine`` roofline), ``memory_formulas`` (the
fit in B and L), ``memory_model`` (``MemoryModel``, ``analyse``), ``memory_report``
(``memory_table``, ``explain_memory``).  Every public name is importable from here.
"""
from __future__ import annotations

from mambac.memory_costs import (MATMUL_FUNCTIONS, MATMUL_MODULES, OP_FLOPS, Machine, NodeCost,  # noqa: F401
                                 is_matmul, node_cost, op_name)
from mambac.memory_formulas import B, L, fit_formulas  # noqa: F401
from mambac.memory_model import MEMORY_PLAN, MemoryModel, analyse  # noqa: F401
from mambac.memory_record import (Measured, Storage, example_dims, measure_saved, run_saved,  # noqa: F401
                                  snapshot)
from mambac.memory_report import NodeRow, explain_memory, human, memory_table, plan_of  # noqa: F401

__all__ = ["B", "L", "Machine", "MemoryModel", "NodeRow", "Storage", "analyse", "explain_memory",
           "measure_saved", "memory_table", "human", "MEMORY_PLAN", "Measured", "NodeCost", "example_dims",
           "fit_formulas", "is_matmul", "node_cost", "op_name", "plan_of", "run_saved", "snapshot"]
