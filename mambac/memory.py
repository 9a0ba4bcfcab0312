"""The memory model: what autograd keeps from the forward pass for the backward pass, node by node,
as exact bytes at the example shape and as formulas in the batch size ``B`` and sequence length
``L``, plus what each node would cost to recompute.  docs/memory.md explains it at length.

Saved tensors are found by asking autograd: the lowered graph runs on fake tensors with grad on and
a ``saved_tensors_hooks`` pack hook, so what counts is exactly what PyTorch saves (custom ops their
tensor inputs, linears input and weight, ``exp`` its result, ...), under autocast too.  They are
grouped by storage (a view keeps its base alive) and attributed to the node that allocated the
storage (or, for a temporary made inside a node, to that node); parameters and graph inputs are
left out.  Formulas: the run is repeated at (2B, L), (B, 2L), (2B, 2L), fitted exactly by
``a + b*B + c*L + d*B*L`` and checked at (3B, 3L); what is not bilinear gets ``None``.  Costs:
FLOPs (``2*M*N*K`` for matmuls, SSM ops from their shapes, ~1 per element otherwise) and bytes
moved, turned into seconds by a ``Machine`` roofline.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Iterable, Sequence

import sympy
import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from mambac.ir import SOURCE, VAL
from mambac.ops._common import info_for_target

B, L = sympy.symbols("B L", positive=True, integer=True)
MEMORY_PLAN = "mambac_memory"   # gm.meta: the RematPlan that plan_remat chose (with its MemoryModel)

MATMUL_FUNCTIONS = (F.linear, torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.einsum, torch.addmm)
MATMUL_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d)


@dataclass(frozen=True)
class Machine:
    """Roofline used to turn FLOPs and bytes into seconds (defaults: one H200, dense bf16)."""

    flops_per_s: float = 989e12
    bytes_per_s: float = 4.8e12

    def seconds(self, flops: int, nbytes: int) -> float:
        return max(flops / self.flops_per_s, nbytes / self.bytes_per_s)


@dataclass(frozen=True)
class Storage:
    """One activation storage: who allocated it, its size, and which nodes' backward keeps it."""

    key: str
    producer: str
    nbytes: int
    savers: tuple[str, ...]
    internal: bool = False  # a temporary made inside ``producer`` (not one of its outputs)


@dataclass(frozen=True)
class NodeCost:
    """Forward cost of one node at the example shape: FLOPs and bytes read plus written."""

    flops: int
    io_bytes: int


@dataclass(frozen=True)
class NodeRow:
    """One row of ``memory_table``: a node's saved bytes, cost and remat decision."""

    name: str
    op: str
    module: str
    out_bytes: int
    saved_bytes: int
    kept_bytes: int
    saved_formula: sympy.Expr | None
    flops: int
    flops_formula: sympy.Expr | None
    region: str | None


@dataclass
class _Run:
    """What one fake run observed."""

    storages: dict[str, Storage]
    values: dict[str, tuple[str, ...]]
    costs: dict[str, NodeCost]


@dataclass
class MemoryModel:
    """Saved-for-backward storages and node costs of one graph at its example shape."""

    example: tuple[int, int]
    run: _Run
    order: tuple[str, ...]
    ops: dict[str, str]
    modules: dict[str, str]
    autocast: tuple[str, torch.dtype | None] = ("cpu", None)
    machine: Machine = field(default_factory=Machine)
    graph: torch.fx.GraphModule | None = None   # an unplanned copy, for fitting formulas
    _formulas: dict[str, sympy.Expr | None] | None = None

    @property
    def storages(self) -> dict[str, Storage]:
        return self.run.storages

    def kept(self, regions: Sequence[Any] = ()) -> list[Storage]:
        """Storages alive between forward and backward when ``regions`` (each with the names of
        its ``nodes`` and ``inputs``, e.g. a ``RegionSpec``) are recomputed: those some node outside
        every region saves, plus the storages of every region's inputs (the checkpoint keeps them)."""
        inside = {n for r in regions for n in r.nodes}
        pinned = {k for r in regions for i in r.inputs for k in self.run.values.get(i, ())}
        return [s for s in self.run.storages.values()
                if s.key in pinned or any(v not in inside for v in s.savers)]

    def predict(self, regions: Sequence[Any] = ()) -> int:
        """Saved-for-backward bytes at the example shape with ``regions`` recomputed."""
        return sum(s.nbytes for s in self.kept(regions))

    def cost(self, nodes: Iterable[str]) -> float:
        """Seconds to recompute ``nodes`` once (roofline of each node's FLOPs and bytes)."""
        zero = NodeCost(0, 0)
        return sum(self.machine.seconds(c.flops, c.io_bytes) for c in (self.run.costs.get(n, zero) for n in nodes))

    def flops(self, nodes: Iterable[str]) -> int:
        return sum(self.run.costs[n].flops for n in nodes if n in self.run.costs)

    # ---- formulas -----------------------------------------------------------------------

    def formula(self, key: str) -> sympy.Expr | None:
        """Bytes of storage ``key`` (or ``flops:<node>``) as a polynomial in B and L, if bilinear."""
        if self._formulas is None:
            self._formulas = fit_formulas(self)
        return self._formulas.get(key)

    def total_formula(self, storages: Iterable[Storage]) -> sympy.Expr | None:
        terms = [self.formula(s.key) for s in storages]
        return None if any(t is None for t in terms) else sympy.factor(sympy.Add(*terms))


# ---------------------------------------------------------------------------------------------
# one fake run with autograd, recording what is saved
# ---------------------------------------------------------------------------------------------

def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _contiguous(value: Any) -> Any:
    """A mambac op's outputs as its eager implementation returns them: contiguous.  (Some fake
    functions return ``empty_like(x)``, which copies a transposed input's strides; a view taken
    of such an output would look free here while the real one copies.)"""
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, (tuple, list)):
        return type(value)(_contiguous(v) for v in value)
    return value


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
        if n.op == "call_function" and info_for_target(n.target) is not None:
            out = _contiguous(out)
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


def example_dims(gm: torch.fx.GraphModule) -> tuple[int, int] | None:
    """(B, L) of the program: dims 0 and 1 of its first tensor input of rank >= 2."""
    for n in gm.graph.nodes:
        v = n.meta.get(VAL)
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() >= 2:
            return int(v.shape[0]), int(v.shape[1])
    return None


def _fake_inputs(gm: torch.fx.GraphModule, mode: FakeTensorMode, at: tuple[int, int] | None) -> list[Any]:
    """Fake graph inputs at (B, L) = ``at``: in inputs of rank >= 2, dim 0 follows B and dim 1
    follows L where they equal the example's (token ids and labels (B, L); activations (B, L, ...))."""
    ex, out = example_dims(gm), []
    for v in (n.meta.get(VAL) for n in gm.graph.nodes if n.op == "placeholder"):
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        shape = list(v.shape)
        if at is not None and ex is not None and len(shape) >= 2:
            shape[:2] = [a if s == e else s for s, e, a in zip(shape[:2], ex, at)]
        with mode:
            out.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
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
    try:
        with torch.inference_mode(False), torch.enable_grad(), mode, \
                torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            rec.run(*inputs)
    finally:
        torch.set_autocast_cache_enabled(cache)
    storages = {k: Storage(k, p, nb, tuple(sorted(s)), internal) for k, (p, nb, s, internal) in rec.info.items()}
    return _Run(storages=storages, values=rec.values, costs=rec.costs)


def _autocast_state(gm: torch.fx.GraphModule) -> tuple[str, torch.dtype | None]:
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


def analyse(gm: torch.fx.GraphModule, machine: Machine | None = None) -> MemoryModel:
    """The memory model of ``gm`` (an unplanned lowered graph with shapes) at its example shape."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    return MemoryModel(
        example=example_dims(gm) or (0, 0), run=run_saved(gm),
        order=tuple(n.name for n in nodes), ops={n.name: op_name(n) for n in nodes},
        modules={n.name: getattr(n.meta.get(SOURCE), "module_path", "") for n in nodes},
        autocast=_autocast_state(gm), machine=machine or Machine(), graph=snapshot(gm))


# ---------------------------------------------------------------------------------------------
# formulas
# ---------------------------------------------------------------------------------------------

def _bilinear(v00: int, v10: int, v01: int, v11: int, b: tuple[int, int], l: tuple[int, int]):
    d = Fraction(v11 - v10 - v01 + v00, (b[1] - b[0]) * (l[1] - l[0]))
    cb = Fraction(v10 - v00, b[1] - b[0]) - d * l[0]
    cl = Fraction(v01 - v00, l[1] - l[0]) - d * b[0]
    c0 = v00 - cb * b[0] - cl * l[0] - d * b[0] * l[0]
    return c0, cb, cl, d


def _as_expr(coef) -> sympy.Expr:
    c0, cb, cl, d = (sympy.Rational(c.numerator, c.denominator) for c in coef)
    return c0 + cb * B + cl * L + d * B * L


def fit_formulas(model: MemoryModel) -> dict[str, sympy.Expr | None]:
    """Fit every storage's bytes and every node's FLOPs over fake runs at four more shapes."""
    b0, l0 = model.example
    if model.graph is None or not b0 or not l0:
        return {}
    pts = [(2 * b0, l0), (b0, 2 * l0), (2 * b0, 2 * l0), (3 * b0, 3 * l0)]
    dev, dtype = model.autocast
    try:
        with torch.autocast(dev, dtype=dtype, enabled=dtype is not None):
            runs = [model.run] + [run_saved(model.graph, p) for p in pts]
    except Exception:  # a graph specialised to its example shape: no formulas, numbers still exact
        return {}
    series = {k: [r.storages[k].nbytes if k in r.storages else None for r in runs] for k in model.storages}
    series.update({f"flops:{n}": [r.costs[n].flops if n in r.costs else None for r in runs] for n in model.run.costs})
    out: dict[str, sympy.Expr | None] = {}
    for key, vals in series.items():
        if any(v is None for v in vals):
            out[key] = None
            continue
        coef = _bilinear(vals[0], vals[1], vals[2], vals[3], (b0, 2 * b0), (l0, 2 * l0))
        c0, cb, cl, d = coef
        exact = c0 + cb * 3 * b0 + cl * 3 * l0 + d * 9 * b0 * l0 == vals[4]
        out[key] = _as_expr(coef) if exact else None
    return out


# ---------------------------------------------------------------------------------------------
# costs
# ---------------------------------------------------------------------------------------------

def op_name(n: torch.fx.Node) -> str:
    """A short printable name of what a node does."""
    if n.op == "call_module":
        return f"self.{str(n.target).rsplit('.', 1)[-1]}"
    if n.op == "call_method":
        return f".{n.target}"
    info = info_for_target(n.target) if n.op == "call_function" else None
    if info is not None:
        return f"mambac.{info.name}"
    return getattr(n.target, "__name__", str(n.target))


def is_matmul(gm: torch.fx.GraphModule, n: torch.fx.Node) -> bool:
    """Whether ``n`` is a matrix product (recomputing it is what remat avoids first)."""
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), MATMUL_MODULES)
    if n.op == "call_method":
        return n.target in ("matmul", "bmm", "mm")
    return n.op == "call_function" and any(n.target is f for f in MATMUL_FUNCTIONS)


def _first(args: Sequence[Any]) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _scan_flops(x: torch.Tensor, bmat: torch.Tensor, groups: int, chunk: int, rank: int = 1) -> int:
    """Chunked scans over x (b, l, h, p): intra-chunk (C.B) and (weights @ x) products, chunk
    states in and out, the elementwise epilogue; ``rank`` multiplies it (Mamba-3's trapezoid, MIMO)."""
    b, l, h, p = x.shape
    n, t = bmat.shape[-1], min(chunk, l)
    return rank * (2 * b * l * t * (groups * n + h * p) + 4 * b * l * h * p * n + 10 * b * l * h * p)


OP_FLOPS: dict[str, Callable[[Sequence[Any]], int]] = {   # an op's OpInfo.extra["remat_flops"] wins
    "ssd": lambda a: _scan_flops(a[0], a[3], a[3].shape[-2], a[9]),
    "selective_scan": lambda a: 20 * a[0].numel() * a[2].shape[1],   # exp, drive, ~6 scan passes, C.h
    "causal_conv1d": lambda a: 2 * a[0].numel() * a[1].shape[-1],
    "gated_rmsnorm": lambda a: 6 * a[0].numel(),
    "add_rmsnorm": lambda a: 6 * a[0].numel(),
    "mamba3_siso": lambda a: _scan_flops(a[0], a[1], a[0].shape[2], a[-1], rank=2),
    "mamba3_mimo": lambda a: _scan_flops(a[0], a[1], a[0].shape[2], a[-1], rank=2 * a[1].shape[2]),
}


def _flops(gm: torch.fx.GraphModule, n: torch.fx.Node, args, out: Any) -> int:
    outs = _tensors(out)
    numel = sum(t.numel() for t in outs)
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, torch.nn.Linear):
            return 2 * numel * mod.in_features
        return 0 if isinstance(mod, torch.nn.Embedding) else numel
    if is_matmul(gm, n):
        a = _first(args)
        return 2 * numel * (a.shape[-1] if a is not None and a.dim() else 1)
    info = info_for_target(n.target) if n.op == "call_function" else None
    if info is not None:
        rule = info.extra.get("remat_flops") or OP_FLOPS.get(info.name)
        return int(rule(args)) if rule is not None else 10 * numel
    if n.op == "call_function" and n.target is F.cross_entropy:
        return 5 * _first(args).numel()
    return numel


def node_cost(gm: torch.fx.GraphModule, n: torch.fx.Node, args, kwargs, out: Any, new_bytes: int) -> NodeCost:
    """FLOPs and bytes of one node run; a node that allocates nothing (a view) is free."""
    if n.op == "get_attr" or (new_bytes == 0 and n.op != "call_module" and info_for_target(n.target) is None):
        return NodeCost(0, 0)
    in_bytes = sum(t.numel() * t.element_size() for t in _tensors(list(args) + list(kwargs.values())))
    return NodeCost(_flops(gm, n, args, out), in_bytes + new_bytes)


# ---------------------------------------------------------------------------------------------
# reports
# ---------------------------------------------------------------------------------------------

def human(nbytes: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _programs(obj: Any) -> list[torch.fx.GraphModule]:
    if isinstance(obj, torch.fx.GraphModule):
        return [obj]
    if hasattr(obj, "gm"):
        return [obj.gm]
    programs = getattr(obj, "programs", None)
    if programs is None:
        raise TypeError(f"explain_memory takes a compiled module, a lowered program or a GraphModule, "
                        f"got {type(obj).__name__}")
    if not programs:
        raise RuntimeError("nothing lowered yet: call the module (or mambac.compile with example_inputs) first")
    return [p.gm for p in programs.values()]


def plan_of(gm: torch.fx.GraphModule):
    """The RematPlan plan_remat left on ``gm``, or a no-remat plan computed now (under the autocast
    in force now) and kept there."""
    if MEMORY_PLAN not in gm.meta:
        from mambac.passes.plan_remat import make_plan
        gm.meta[MEMORY_PLAN] = make_plan(gm, "none", None)
    return gm.meta[MEMORY_PLAN]


def memory_table(obj: Any) -> list[NodeRow]:
    """Per-node rows of the (first) program: saved bytes without remat and kept under its plan,
    the formula of the saved bytes, FLOPs and their formula, the region recomputing the node."""
    plan = plan_of(_programs(obj)[0])
    model = plan.model
    region_of = {n: r.name for r in plan.regions for n in r.nodes}
    kept = {s.key for s in model.kept(plan.regions)}
    made: dict[str, list[Storage]] = {}
    for s in model.storages.values():
        made.setdefault(s.producer, []).append(s)
    rows = []
    for name in model.order:
        mine = made.get(name, [])
        saved = [s for s in mine if s.savers]
        rows.append(NodeRow(
            name=name, op=model.ops[name], module=model.modules[name],
            out_bytes=sum(s.nbytes for s in mine if not s.internal), saved_bytes=sum(s.nbytes for s in saved),
            kept_bytes=sum(s.nbytes for s in mine if s.key in kept), saved_formula=model.total_formula(saved),
            flops=model.flops([name]), flops_formula=model.formula(f"flops:{name}"), region=region_of.get(name)))
    return rows


def explain_memory(obj: Any, top: int = 12) -> str:
    """A printable report per program: saved-for-backward bytes without remat and with the plan
    (with their formulas in B and L), the budget, what each region recomputes and frees, and the
    nodes whose outputs weigh most."""
    return "\n\n".join(_summary(gm) + _regions(gm) + _largest(gm, top) for gm in _programs(obj))


def _summary(gm: torch.fx.GraphModule) -> str:
    plan = plan_of(gm)
    model = plan.model
    dev, dtype = model.autocast
    lines = [f"mambac memory report: remat='{plan.mode}', example B={model.example[0]}, L={model.example[1]}"
             + (f", {dev} autocast {str(dtype).replace('torch.', '')}" if dtype is not None else ""),
             "saved for backward (activations; parameters and inputs excluded):",
             f"  without remat : {human(plan.baseline):>11}   = {model.total_formula(model.kept())}",
             f"  with this plan: {human(plan.predicted):>11}   = {model.total_formula(model.kept(plan.regions))}"]
    if plan.budget is not None:
        lines.append(f"  budget        : {human(plan.budget):>11}   ({'met' if plan.predicted <= plan.budget else 'NOT met'}"
                     f"; the least reachable is {human(plan.minimum or 0)})")
    return "\n".join(lines) + "\n"


def _regions(gm: torch.fx.GraphModule) -> str:
    plan = plan_of(gm)
    model = plan.model
    fwd, extra = model.flops(model.order), model.flops(n for r in plan.regions for n in r.nodes)
    lines = [f"recomputed in backward: {len(plan.regions)} regions, {sum(len(r.nodes) for r in plan.regions)} nodes, "
             f"{extra / 1e9:.3g} GFLOP ({100 * extra / max(fwd, 1):.1f}% of the forward's {fwd / 1e9:.3g} GFLOP)"]
    base = model.kept()
    for r in plan.regions:
        still = {k.key for k in model.kept([r])}
        freed = sum(s.nbytes for s in base if s.key not in still)
        ops = dict.fromkeys(model.ops[n] for n in r.nodes if model.run.costs[n].io_bytes)
        lines.append(f"  {r.name} ({r.kind}, {len(r.nodes)} nodes, frees {human(freed)}, "
                     f"{model.flops(r.nodes) / 1e9:.3g} GFLOP): " + ", ".join(ops))
    return "\n".join(lines) + "\n"


def _largest(gm: torch.fx.GraphModule, top: int) -> str:
    rows = [r for r in sorted(memory_table(gm), key=lambda r: -r.saved_bytes)[:top] if r.saved_bytes]
    lines = ["largest saved activations (node | op | module | saved | kept | formula | flops):"]
    lines += [f"  {r.name} | {r.op} | {r.module or '-'} | {human(r.saved_bytes)} | {human(r.kept_bytes)} | "
              f"{r.saved_formula} | {r.flops_formula if r.flops_formula is not None else r.flops}" for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# measuring the real thing
# ---------------------------------------------------------------------------------------------

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


__all__ = ["B", "L", "Machine", "MemoryModel", "NodeRow", "Storage", "analyse", "explain_memory",
           "measure_saved", "memory_table", "human", "MEMORY_PLAN"]
