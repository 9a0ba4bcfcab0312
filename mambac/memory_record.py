"""What autograd saves, observed: one fake run of a lowered graph with grad on and a
``saved_tensors_hooks`` pack hook, attributing every saved storage to the node that allocated it
(``run_saved``); and the same count on a real run (``measure_saved``).  Part of ``mambac.memory``
(docs/memory.md)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode

from mambac.ir import KERNELS, VAL
from mambac.memory_costs import NodeCost, _tensors, node_cost


@dataclass(frozen=True)
class Storage:
    """One activation storage: who allocated it, its size, and which nodes' backward keeps it."""

    key: str
    producer: str
    nbytes: int
    savers: tuple[str, ...]
    internal: bool = False  # a temporary made inside ``producer`` (not one of its outputs)


@dataclass
class _Run:
    """What one fake run observed."""

    storages: dict[str, Storage]
    values: dict[str, tuple[str, ...]]
    costs: dict[str, NodeCost]


class _Recorder(torch.fx.Interpreter):
    """Runs the graph node by node, attributing every new storage to the node that made it and
    every tensor the pack hook sees to the node being run."""

    def __init__(self, gm: torch.fx.GraphModule, fixed: set[int]) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.fixed = fixed                       # storages of parameters and inputs
        self.owner: dict[int, str] = {}          # storage id -> storage key
        self.info: dict[str, list] = {}          # key -> [producer, nbytes, savers, internal]
        self.values: dict[str, tuple[str, ...]] = {}
        self.costs: dict[str, NodeCost] = {}
        self.alive: list[Any] = []               # keeps storages alive so ids are never reused
        self.pending: list[Any] = []
        self.current = ""

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        sid = st._cdata
        if sid in self.fixed or st.nbytes() == 0:
            return t
        if sid in self.owner:
            self.info[self.owner[sid]][2].add(self.current)
        else:
            self.pending.append(st)
        return t

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current, self.pending = n.name, []
        out = super().run_node(n)
        if n.op in ("placeholder", "output"):
            return out
        tensors, keys, new = _tensors(out), [], 0
        for k, t in enumerate(tensors):  # name the storages n returns; views keep their base's name
            st = t.untyped_storage()
            if st._cdata in self.fixed:
                continue
            if st._cdata not in self.owner:
                new += self._own(st, n.name if len(tensors) == 1 else f"{n.name}[{k}]", n.name, False)
            keys.append(self.owner[st._cdata])
        self.values[n.name] = tuple(dict.fromkeys(keys))
        for j, st in enumerate(self.pending):  # saved, yet not an output: a temporary made inside n
            if st._cdata not in self.owner:
                self._own(st, f"{n.name}~{j}", n.name, True)
            self.info[self.owner[st._cdata]][2].add(n.name)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        self.costs[n.name] = node_cost(self.module, n, args, kwargs, out, new)
        return out

    def _own(self, st: Any, key: str, producer: str, internal: bool) -> int:
        self.owner[st._cdata] = key
        self.info[key] = [producer, st.nbytes(), set(), internal]
        self.alive.append(st)
        return st.nbytes()


def size_hint(x: Any) -> int:
    """The integer a size stands for in this example, without a guard: a symbolic size (a graph
    that ``torch.compile`` traced with dynamic shapes) gives its hint, the value it has for the
    example inputs.  ``int()`` of it would specialise the compiled graph to that value."""
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        if hint is None:
            hint = x.node.shape_env.size_hint(x.node.expr)
        return int(hint)
    return int(x)


def is_parameter_input(n: torch.fx.Node) -> bool:
    """Whether placeholder ``n`` is a parameter or buffer that dynamo lifted to a graph input
    (``torch.compile`` graphs take the model's parameters as inputs, marked static)."""
    v = n.meta.get(VAL)
    return isinstance(v, torch.nn.Parameter) or "_dynamo_static_input_type" in (n.meta.get("tensor_dict") or {})


def _requires_grad(n: torch.fx.Node) -> bool:
    """Whether input ``n`` requires grad (dynamo's own example value says so for the parameters it
    lifted to inputs, where the value the passes propagated may not)."""
    return any(getattr(n.meta.get(k), "requires_grad", False) for k in (VAL, "example_value"))


def _data_inputs(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and not is_parameter_input(n)]


def example_dims(gm: torch.fx.GraphModule) -> tuple[int, int] | None:
    """(B, L) of the program: dims 0 and 1 of its first tensor input of rank >= 2 (parameters
    that are graph inputs left out)."""
    for n in _data_inputs(gm):
        v = n.meta.get(VAL)
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return size_hint(v.shape[0]), size_hint(v.shape[1])
    return None


def _fake_inputs(gm: torch.fx.GraphModule, mode: FakeTensorMode, at: tuple[int, int] | None) -> list[Any]:
    """Fake graph inputs, of concrete sizes, at (B, L) = ``at``: in data inputs of rank >= 2, dim 0
    follows B and dim 1 follows L where they equal the example's (token ids and labels (B, L);
    activations (B, L, ...)).  A symbolic size becomes its example value, or the new B or L where
    it is one of those dims' symbols; so do integer inputs that are such a size (dynamo passes the
    sequence length as one)."""
    ex, data = example_dims(gm), set(_data_inputs(gm))
    inputs = [(n.meta.get(VAL), n in data, _requires_grad(n)) for n in gm.graph.nodes if n.op == "placeholder"]
    moved: dict[Any, int] = {}   # symbol of a dim that follows B or L -> its value at ``at``
    if at is not None and ex is not None:
        for v, is_data, _ in inputs:
            if is_data and isinstance(v, torch.Tensor) and v.dim() >= 2:
                for s, e, a in zip(v.shape[:2], ex, at):
                    if isinstance(s, torch.SymInt) and size_hint(s) == e and s.node.expr.is_Symbol:
                        moved[s.node.expr] = a

    def concrete(s: Any) -> int:
        if isinstance(s, torch.SymInt) and moved:
            expr = s.node.expr.xreplace(moved)
            if expr.is_number:
                return int(expr)
        return size_hint(s)

    out = []
    for v, is_data, grad in inputs:
        if isinstance(v, torch.SymInt):
            out.append(concrete(v))
            continue
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        shape = [concrete(s) for s in v.shape]
        if is_data and at is not None and ex is not None and len(shape) >= 2:
            shape[:2] = [a if s == e else s for s, e, a in zip(shape[:2], ex, at)]
        with mode:  # parameters lifted to inputs keep requires_grad, so autograd saves for them
            z = torch.zeros(shape, dtype=v.dtype, device=v.device)
            out.append(z.requires_grad_() if grad and z.is_floating_point() else z)
    return out


def run_saved(gm: torch.fx.GraphModule, at: tuple[int, int] | None = None) -> _Run:
    """Run ``gm`` on fake inputs at (B, L) = ``at`` (the example shape when None) with grad on and
    record what autograd saves (see the module docstring)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    real = list(gm.parameters()) + list(gm.buffers())
    with mode:
        fakes = [mode.from_tensor(t) for t in real]      # memoised: ops see these same fakes
    inputs = _fake_inputs(gm, mode, at)
    fixed = {t.untyped_storage()._cdata for t in real + fakes + _tensors(inputs)}
    rec = _Recorder(gm, fixed)
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)  # else fake weight casts would be cached for the real run
    from mambac.ops import use_kernels
    try:  # under the program's kernel mode: forms that differ by mode (cp's SSD) save what they will save
        with torch.inference_mode(False), torch.enable_grad(), mode, use_kernels(gm.meta.get(KERNELS, "auto")), \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            rec.run(*inputs)
    finally:
        torch.set_autocast_cache_enabled(cache)
    storages = {k: Storage(k, p, nb, tuple(sorted(s)), internal) for k, (p, nb, s, internal) in rec.info.items()}
    return _Run(storages=storages, values=rec.values, costs=rec.costs)


def autocast_state(gm: torch.fx.GraphModule) -> tuple[str, torch.dtype | None]:
    """(device type, autocast dtype or None): the autocast in force while the program is lowered,
    which is the one it is assumed to run under."""
    dev = next((n.meta[VAL].device.type for n in gm.graph.nodes
                if n.op == "placeholder" and isinstance(n.meta.get(VAL), torch.Tensor)), "cpu")
    return dev, (torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None)


def snapshot(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph sharing its modules and parameters."""
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copy.meta.update(gm.meta)
    return copy


@dataclass
class Measured:
    """Bytes of the distinct storages autograd saved during one forward (excluded ones left out)."""

    nbytes: int
    count: int
    output: Any


def measure_saved(fn: Callable[..., Any], *args: Any, exclude: Iterable[torch.Tensor] = ()) -> Measured:
    """Run ``fn(*args)`` with a pack hook and add up the storages it saves, deduplicated by their
    data pointer; storages of ``exclude`` (parameters, inputs) are left out.  The output is
    returned so the caller can run backward."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}
    held: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip and st.nbytes() > 0:
            seen[st.data_ptr()] = st.nbytes()
            held.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return Measured(nbytes=sum(seen.values()), count=len(seen), output=out)
