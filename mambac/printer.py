"""Render a GraphModule as readable Python with shapes, dtypes and annotations as comments.

The first line names the pass that produced the graph (and the rank it belongs to); every node is
one line ``name = target(args)  # f32[2, 16, 64] | placement | fused: ... | module path``.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx

from mambac.ir import FUSION, PLACEMENT, SOURCE, VAL

_DTYPES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16", torch.float16: "f16",
           torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}


def format_val(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{_DTYPES.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join("None" if v is None else format_val(v) for v in val) + ")"
    return "" if val is None else type(val).__name__


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_module":
        return f"self.{t}"
    if node.op == "call_method":
        return f".{t}"
    if node.op == "get_attr":
        return f"self.{t}"
    if hasattr(t, "_qualified_op_name"):
        return t._qualified_op_name.replace("::", ".")
    name = getattr(t, "__name__", str(t))
    mod = getattr(t, "__module__", "") or ""
    if mod in ("_operator", "operator"):
        return f"operator.{name}"
    return f"{mod.replace('torch._C._nn', 'F').replace('torch.nn.functional', 'F')}.{name}" if mod else name


def _fmt_arg(a: Any) -> str:
    if isinstance(a, torch.fx.Node):
        return a.name
    if isinstance(a, (tuple, list)):
        inner = ", ".join(_fmt_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def format_node(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        head = f"{node.name} = input()"
    elif node.op == "output":
        return f"return {_fmt_arg(node.args[0])}"
    else:
        parts = [_fmt_arg(a) for a in node.args] + [f"{k}={_fmt_arg(v)}" for k, v in node.kwargs.items()]
        if node.op == "call_method":
            head = f"{node.name} = {parts[0]}{_target_name(node)}({', '.join(parts[1:])})"
        elif node.op == "get_attr":
            head = f"{node.name} = {_target_name(node)}"
        else:
            head = f"{node.name} = {_target_name(node)}({', '.join(parts)})"
    notes = [format_val(node.meta.get(VAL))]
    if PLACEMENT in node.meta:
        notes.append(str(node.meta[PLACEMENT]))
    if FUSION in node.meta and node.meta[FUSION].fusions:
        notes.append("fused: " + "+".join(node.meta[FUSION].fusions))
    src = node.meta.get(SOURCE)
    if src is not None and src.module_path:
        notes.append(src.module_path)
    notes = [n for n in notes if n]
    return head + ("  # " + " | ".join(notes) if notes else "")


def print_graph(gm: torch.fx.GraphModule, stage: str = "capture", rank: int = 0, world_size: int = 1) -> str:
    """The whole graph as text; the first line names the pass (stage) and the rank."""
    lines = [f"# mambac graph after '{stage}' (rank {rank} of {world_size})", "def forward(self):"]
    lines += ["    " + format_node(n) for n in gm.graph.nodes]
    return "\n".join(lines) + "\n"


def to_dot(gm: torch.fx.GraphModule, stage: str = "capture") -> str:
    """Graphviz source of the graph (one box per node, labelled like the text printer)."""
    out = [f'digraph "{stage}" {{', "  node [shape=box, fontname=monospace, fontsize=9];"]
    for n in gm.graph.nodes:
        label = format_node(n).replace("\\", "\\\\").replace('"', '\\"')
        out.append(f'  "{n.name}" [label="{label}"];')
        for a in n.all_input_nodes:
            out.append(f'  "{a.name}" -> "{n.name}";')
    out.append("}")
    return "\n".join(out) + "\n"
