"""The one helper through which passes edit graphs: insert, re-argument and replace nodes while
keeping ``meta['val']`` (shapes), provenance and topological order valid.

Passes never assign ``node.args`` directly; they call these functions so every new or changed node
gets its fake value recomputed with the graph's fake mode.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch
import torch.fx
from torch.fx.node import map_arg

from mambac.capture import FAKE_MODE_KEY, symbolic_dispatch
from mambac.ir import SOURCE, VAL, SourceInfo, source_of
from mambac.ops._common import info_for_target



def _fake_mode(node: torch.fx.Node):
    return node.graph.owning_module.meta.get(FAKE_MODE_KEY)


def compute_val(node: torch.fx.Node) -> Any:
    """Evaluate ``node`` on the fake values of its inputs (the graph's fake mode)."""
    gm = node.graph.owning_module
    args = map_arg(node.args, lambda n: n.meta[VAL])
    kwargs = map_arg(node.kwargs, lambda n: n.meta[VAL])
    mode = _fake_mode(node)
    with mode, symbolic_dispatch(mode):
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return gm.get_submodule(node.target)(*args, **kwargs)
        if node.op == "get_attr":
            return mode.from_tensor(getattr_path(gm, node.target))
    raise ValueError(f"cannot evaluate a {node.op} node")


def getattr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def refresh(node: torch.fx.Node) -> torch.fx.Node:
    node.meta[VAL] = compute_val(node)
    return node


_UNKNOWN = object()


def insert_before(anchor: torch.fx.Node, op: str, target: Any, args: tuple, kwargs: dict | None = None,
                  created_by: str = "", name: str | None = None, val: Any = _UNKNOWN) -> torch.fx.Node:
    """Create a node just before ``anchor``, inheriting its module provenance; shapes computed
    (or taken from ``val`` when the caller already knows the node's value)."""
    with anchor.graph.inserting_before(anchor):
        node = anchor.graph.create_node(op, target, args, kwargs or {}, name=name)
    src = source_of(anchor)
    node.meta[SOURCE] = SourceInfo(src.module_path, src.module_type, created_by or src.created_by)
    if val is not _UNKNOWN:
        node.meta[VAL] = val
        return node
    return refresh(node)


def insert_after(anchor: torch.fx.Node, op: str, target: Any, args: tuple, kwargs: dict | None = None,
                 created_by: str = "", name: str | None = None, val: Any = _UNKNOWN) -> torch.fx.Node:
    """Create a node just after ``anchor``; see ``insert_before``."""
    nxt = anchor.next
    return insert_before(nxt, op, target, args, kwargs, created_by, name, val)


def set_op_args(node: torch.fx.Node, **updates: Any) -> None:
    """Change a mambac op's arguments by schema name, hoisting new inputs above it if needed."""
    info = info_for_target(node.target)
    if info is None:
        raise ValueError(f"{node.name} is not a mambac op")
    for name, value in updates.items():
        if isinstance(value, torch.fx.Node):
            hoist_before(value, node)
        node.update_arg(info.arg_names.index(name), value)
    refresh(node)


def op_arg(node: torch.fx.Node, name: str) -> Any:
    """A mambac op node's argument by schema name."""
    info = info_for_target(node.target)
    return node.args[info.arg_names.index(name)]


def _position(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def hoist_before(node: torch.fx.Node, anchor: torch.fx.Node) -> None:
    """Move ``node`` and whatever it needs that comes after ``anchor`` to just before ``anchor``.

    Only pure nodes are moved (views, casts, parameter reads), so program order is preserved."""
    pos = _position(node.graph)
    _hoist(node, anchor, pos)


def _hoist(node: torch.fx.Node, anchor: torch.fx.Node, pos: dict) -> None:
    if pos[node] < pos[anchor]:
        return
    if node.op in ("placeholder", "output"):
        raise ValueError(f"cannot move {node.op} {node.name}")
    for inp in node.all_input_nodes:
        _hoist(inp, anchor, pos)
    anchor.prepend(node)
    pos[node] = pos[anchor] - 0.5


def replace_uses(old: torch.fx.Node, new: torch.fx.Node) -> None:
    """Point every user of ``old`` at ``new`` and erase ``old`` (its own inputs may become dead;
    ``eliminate_dead_code`` removes them), so use counts seen by later matches are exact."""
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)


def replace_input(user: torch.fx.Node, old: torch.fx.Node, new: torch.fx.Node) -> None:
    """Make ``user`` read ``new`` where it read ``old`` (``new`` must come before ``user``); the
    user's value does not change, so its shape stays valid."""
    user.replace_input_with(old, new)


def users_of(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(node.users)


def is_call(node: Any, targets: Iterable[Any] = (), methods: Iterable[str] = ()) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function":
        return any(node.target is t for t in targets)
    if node.op == "call_method":
        return node.target in tuple(methods)
    return False


def is_op(node: Any, packet: Any) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and \
        getattr(node.target, "overloadpacket", node.target) is packet


def output_of(node: Any, index: int) -> torch.fx.Node | None:
    """If ``node`` is ``getitem(op_node, index)``, return op_node."""
    import operator
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem \
            and node.args[1] == index and isinstance(node.args[0], torch.fx.Node):
        return node.args[0]
    return None


def shape(node: Any) -> tuple[int, ...] | None:
    v = node.meta.get(VAL) if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def apply_until_fixed(graph: torch.fx.Graph, rule: Callable[[torch.fx.Node], bool]) -> int:
    """Apply ``rule`` to every node (in order) and count how often it rewrote something."""
    n = 0
    for node in list(graph.nodes):  # rules erase at most the node they are given
        if rule(node):
            n += 1
    return n


def collapse_region(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], name: str,
                    wrap: Callable[[torch.fx.GraphModule], torch.nn.Module], created_by: str = "") -> torch.fx.Node:
    """Move ``nodes`` (in graph order; a convex run: no path leaves it and comes back) into a
    sub-GraphModule, register ``wrap(body)`` as submodule ``name`` and call it after the last of
    them.  Values used outside become the call's outputs, read back through ``getitem`` nodes.
    Parameter reads (``get_attr``) are copied into the body, never passed in.  Returns the call."""
    members = set(nodes)
    body, env, inputs = torch.fx.Graph(), {}, []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in members or a in env:
                continue
            env[a] = body.node_copy(a) if a.op == "get_attr" else body.placeholder(a.name)
            env[a].meta = dict(a.meta)
            if a.op != "get_attr":
                inputs.append(a)
        env[n] = body.node_copy(n, lambda x: env[x])
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    body.output(tuple(env[o] for o in outputs))
    sub = torch.fx.GraphModule(gm, body, class_name="RematBody")
    sub.meta[FAKE_MODE_KEY] = gm.meta.get(FAKE_MODE_KEY)
    gm.add_submodule(name, wrap(sub))
    src = source_of(nodes[-1])
    # the region computes exactly what its nodes did: their values are the call's (no need to run
    # the wrapped body on fake tensors, which checkpoint wrappers do not all support)
    vals = tuple(o.meta.get(VAL) for o in outputs)
    call = insert_after(nodes[-1], "call_module", name, tuple(inputs), created_by=created_by, name=name,
                        val=vals)
    anchor = call
    for k, out in enumerate(outputs):
        anchor = insert_after(anchor, "call_function", operator.getitem, (call, k), created_by=created_by,
                              val=vals[k])
        out.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in members)
    for n in (call, *call.users):
        n.meta[SOURCE] = SourceInfo(src.module_path, src.module_type, created_by or src.created_by)
    for n in reversed(nodes):
        n.graph.erase_node(n)
    for a in env:  # parameter reads only the region used
        if a.op == "get_attr" and not a.users:
            a.graph.erase_node(a)
    return call
