"""``mambac explain``: per rank, what a lowered program holds and does — parameters, activation
memory (from ``mambac.memory``), communication per step (collective nodes of the graph), and the
fused kernels it runs."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
import torch.fx

from mambac.ir import VAL, fusion_of
from mambac.lowering import Lowered
from mambac.memory import explain_memory, human
from mambac.ops._common import info_for_target

# Bytes each collective moves per call, forward and backward, as a function of (input, output)
# bytes, following the autograd rules in runtime/collectives.py: all_reduce's backward is an
# identity and grad_all_reduce's forward is; all_gather's backward is a local slice, all_gather_rs's
# a reduce-scatter; reduce_scatter's and shard_slice's backward gather the gradient.
_PAYLOAD = {
    "all_reduce": (lambda i, o: i, lambda i, o: 0),
    "grad_all_reduce": (lambda i, o: 0, lambda i, o: i),
    "all_gather": (lambda i, o: o, lambda i, o: 0),
    "all_gather_rs": (lambda i, o: o, lambda i, o: o),
    "reduce_scatter": (lambda i, o: i, lambda i, o: i),
    "shard_slice": (lambda i, o: 0, lambda i, o: i),
}


def _nbytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _collective(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    name = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", "")
    return name if name in _PAYLOAD else None


def parameters_section(gm: torch.fx.GraphModule) -> str:
    params = list(dict.fromkeys(gm.parameters()))
    count = sum(p.numel() for p in params)
    return f"parameters held by this rank: {count:,} ({human(sum(_nbytes(p) for p in params))})"


def communication_rows(gm: torch.fx.GraphModule) -> list[tuple[str, str, int, int, int]]:
    """(collective, group, calls, forward bytes, backward bytes) per kind and group, per step.
    A context-parallel sequence op counts as one ``cp_exchange`` (all-gather of its carried state
    forward, reduce-scatter backward)."""
    from mambac.runtime.context_parallel import CP_FORMS, exchange_bytes
    acc: dict[tuple[str, str], list[int]] = {}
    for node in gm.graph.nodes:
        kind = _collective(node)
        if node.op == "call_function" and node.target in CP_FORMS:
            vals = tuple(a.meta.get(VAL) if isinstance(a, torch.fx.Node) else a for a in node.args)
            n = exchange_bytes(node.target, vals, tuple(node.meta[VAL]), node.args[-2])
            kind, group, fwd_b, bwd_b = "cp_exchange", str(node.args[-1]), n, n
        elif kind is None:
            continue
        else:
            group = str(node.args[-1])
            i, o = _nbytes(node.args[0].meta.get(VAL)), _nbytes(node.meta.get(VAL))
            fwd, bwd = _PAYLOAD[kind]
            fwd_b, bwd_b = fwd(i, o), bwd(i, o)
        row = acc.setdefault((kind, group), [0, 0, 0])
        row[0] += 1
        row[1] += fwd_b
        row[2] += bwd_b
    return [(k, g, *v) for (k, g), v in sorted(acc.items())]


def layer_formulas_section(model: torch.nn.Module, options) -> str:
    """Every collective of one mixer per step, bytes as formulas of batch and seqlen (``mambac.comm``)."""
    from mambac.comm import layer_comm, total_bytes
    mixer = next((m for m in model.modules() if type(m).__name__ in ("Mamba", "Mamba2", "Mamba3")), None)
    if mixer is None:
        return ""
    rows = layer_comm(mixer, tp=options.tp, cp=options.cp, sequence_parallel=options.sequence_parallel)
    if not rows:
        return ""
    lines = ["communication of one mixer per step (bytes; seqlen is the whole sequence):"]
    lines += [f"  {c.axis:2s} {c.direction:8s} {c.kind:14s} {c.what:24s} {c.bytes}" for c in rows]
    for axis in sorted({c.axis for c in rows}):
        lines.append(f"  total over {axis}: {total_bytes(rows, axis)}")
    return "\n".join(lines)


def communication_section(gm: torch.fx.GraphModule) -> str:
    rows = communication_rows(gm)
    if not rows:
        return "communication: none (single rank)"
    lines = ["communication per step at the example shape (payload bytes per rank):",
             f"  {'collective':16s} {'group':6s} {'calls':>5s} {'forward':>11s} {'backward':>11s}"]
    lines += [f"  {k:16s} {g:6s} {n:5d} {human(f):>11s} {human(b):>11s}" for k, g, n, f, b in rows]
    return "\n".join(lines)


def _all_nodes(gm: torch.fx.GraphModule):
    """Nodes of the graph and of the sub-graphs it calls (recompute regions)."""
    for node in gm.graph.nodes:
        sub = gm.get_submodule(node.target) if node.op == "call_module" else None
        sub = getattr(sub, "body", sub)  # a recompute region runs its body graph
        if isinstance(sub, torch.fx.GraphModule):
            yield from _all_nodes(sub)
        else:
            yield node


def kernels_section(gm: torch.fx.GraphModule) -> str:
    """The fused ops the program runs (recompute regions included), with what each absorbed."""
    seen = Counter()
    for node in _all_nodes(gm):
        info = info_for_target(node.target) if node.op == "call_function" else None
        if info is not None:
            fused = "+".join(fusion_of(node).fusions)
            seen[f"{info.name}" + (f" [{fused}]" if fused else "")] += 1
    lines = ["kernels (fused ops):"] + [f"  {n:3d} x {k}" for k, n in sorted(seen.items())]
    return "\n".join(lines)


def explain(programs: Sequence[Lowered], ranks: Sequence[int] | None = None,
            model: torch.nn.Module | None = None) -> str:
    """The report for the given ranks' programs (all of them by default); with the (unsharded)
    ``model``, also the per-mixer communication formulas."""
    out = []
    for rank, program in enumerate(programs):
        if ranks is not None and rank not in ranks:
            continue
        gm = program.gm
        out.append("\n".join([f"=== rank {rank} of {len(programs)} ===", parameters_section(gm),
                              communication_section(gm), kernels_section(gm), explain_memory(program)]))
    if model is not None and programs:
        formulas = layer_formulas_section(model, programs[0].ctx.options)
        if formulas:
            out.append(formulas)
    return "\n\n".join(out) + "\n"
