"""``plan_remat``: decide what autograd keeps for backward and what it recomputes, and put each
recomputed region into the graph as one call to a checkpointed sub-graph.

Needs: a lowered graph with shapes, one device's or one rank's (the last pass; ``ctx.options.remat``
is 'full' or 'auto', ``memory_budget`` in bytes per rank for 'auto').  Analyses it with
``mambac.memory`` at the example shape (the inputs the program is lowered for); on a rank of
several the graph holds the rank's local (sharded) shapes, so the bytes are the rank's.
Guarantees: the same function and, in fp32, bit-identical gradients (recomputation replays the
same deterministic ops; autograd's graph keeps its shape); each recomputed region is a
``remat_*`` call_module node running a sub-GraphModule through ``RematRegion``, so only the
region's inputs are kept; with 'auto' the predicted
saved-for-backward bytes are at most the budget, or a ``MambacOptionsError`` names the least
budget that can be met.  No region holds a collective that communicates in its forward
(``all_reduce``, ``all_gather``, ``all_gather_rs``, ``reduce_scatter``): regions end before and
start after one, so backward never replays a collective and the collective's output is kept as the
next region's input.  The chosen plan is left in ``gm.meta[MEMORY_PLAN]`` for
``mambac.memory.explain_memory``; counts go to ``ctx.stats['plan_remat']``.

Segments: the residual blocks (the children of the model's layer list, e.g. ``backbone.layers.3``),
the stem before them and the head after them (final norm, LM head, loss).  'full' recomputes each
block whole.  'auto' offers, per segment: nothing; "cheap" regions (maximal runs of nodes between
matrix products: elementwise math, conv, norms, scans) added in order of cost per byte freed; the
whole segment.  Choosing one option per segment at the least recompute time under the budget is a
multiple-choice knapsack, solved exactly over Pareto fronts (see docs/passes/plan_remat.md).
Under tensor parallelism a block is split at its collectives into several regions.
"""
from __future__ import annotations

import contextlib
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from mambac.errors import MambacOptionsError
from mambac.ir import PLACEMENT, SOURCE, VAL, SourceInfo
from mambac.memory import MEMORY_PLAN, MemoryModel, analyse, human, is_matmul
from mambac.memory_record import size_hint
from mambac.passes.context import PassContext
from mambac.passes.rewrite import collapse_region
from mambac.runtime.collectives import FORWARD_COMM, collective_name
from mambac.verifier import verify as check_graph

NAME = "plan_remat"
REMAT = "mambac_remat"    # node.meta: RematTag on every node a region recomputes (kept in its body)


class RematRegion(torch.nn.Module):
    """A recomputed region: autograd keeps only the region's inputs, and backward replays ``body``
    to get what its ops saved.  The replay runs under the kernel mode of the forward
    (``mambac.ops.use_kernels``; backward runs outside the compiled module's own context), so it
    recomputes exactly what the forward computed.

    Runs through ``mambac.runtime.replay`` (one autograd Function: the least host time per call),
    or non-reentrant ``torch.utils.checkpoint`` where the body may draw random numbers (checkpoint
    saves and restores the generators' states around the replay) and where AOTAutograd traces the
    call (the replay then lands in its backward graph, its op nodes carrying their kernel mode)."""

    def __init__(self, body: torch.fx.GraphModule, spec: RegionSpec) -> None:
        super().__init__()
        self.body = body
        self.spec = spec
        # Saving the generators' states costs host time per region, and reading a CUDA generator's
        # state is not allowed while a CUDA graph is being captured: only bodies that draw need it.
        self.random = draws_random_numbers(body)

    def forward(self, *args):
        from mambac.ops import kernel_mode
        from mambac.runtime.replay import replay
        if _tracing():
            return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.random)
        if self.random:
            return self.checkpointed(*args)
        return replay(self.body, args, kernel_mode(), dict(self.body.named_parameters()))

    def checkpointed(self, *args):
        """The region under non-reentrant ``torch.utils.checkpoint``, its replay in the forward's
        kernel mode (and, where the body draws random numbers, with the generators' states)."""
        from mambac.ops import kernel_mode, use_kernels
        mode = kernel_mode()
        return checkpoint(self.body, *args, use_reentrant=False, preserve_rng_state=self.random,
                          context_fn=lambda: (contextlib.nullcontext(), use_kernels(mode)))


RANDOM_NAMES = ("dropout", "rand", "bernoulli", "multinomial", "normal", "uniform", "poisson", "exponential",
                "cauchy", "geometric", "log_normal", "random")


def draws_random_numbers(gm: torch.fx.GraphModule) -> bool:
    """Whether a node of ``gm`` may draw random numbers: a function, method or module whose name
    says so (dropout, rand*, bernoulli, normal_, ...) or a sub-module that does.  Errs towards yes."""
    for n in gm.graph.nodes:
        if n.op == "call_module":
            mod = gm.get_submodule(str(n.target))
            name = type(mod).__name__
            if isinstance(mod, torch.fx.GraphModule) and draws_random_numbers(mod):
                return True
        elif n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        else:
            continue
        if any(word in str(name).lower() for word in RANDOM_NAMES):
            return True
    return False


def _tracing() -> bool:
    """Whether a proxy mode traces this call (AOTAutograd under ``torch.compile``): checkpoint then
    takes no context managers but ``TorchDispatchMode``s, and needs none here, as the traced
    backward replays the region's recorded ops, each op node holding the kernel mode it runs in."""
    get, keys = getattr(torch._C, "_get_dispatch_mode", None), getattr(torch._C, "_TorchDispatchModeKey", None)
    return get is not None and keys is not None and get(keys.PROXY) is not None


@dataclass(frozen=True)
class RegionSpec:
    """A run of nodes recomputed in backward (names); only its ``inputs`` are kept for it."""

    name: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    kind: str = "full"       # "full" (a whole block or segment) or "cheap" (no matmul inside)
    segment: str = ""


@dataclass(frozen=True)
class RematTag:
    """node.meta[REMAT]: the region that recomputes this node."""

    region: str


@dataclass(frozen=True)
class RematPlan:
    """What plan_remat decided: the regions, the budget and the predicted bytes at the example."""

    mode: str
    budget: int | None
    regions: tuple[RegionSpec, ...]
    model: MemoryModel
    baseline: int            # saved-for-backward bytes without remat
    predicted: int           # ... with these regions recomputed
    minimum: int | None      # the least any plan of this pass reaches
    fixed: int = 0           # memory_budget_scope='step': parameters, gradients, AdamW state and the
                             # loss's workspace, taken off memory_budget before ``budget`` (what activations may keep)


@dataclass(frozen=True)
class Segment:
    """A run of consecutive graph nodes planned as a unit: a block, the stem or the head."""

    name: str
    kind: str                      # "block", "stem" or "head"
    nodes: tuple[torch.fx.Node, ...]

    @property
    def tag(self) -> str:
        return re.sub(r"\W", "_", self.name)


@dataclass(frozen=True)
class Option:
    """One way to plan a segment: the regions it recomputes, the bytes it keeps and the cost."""

    regions: tuple[RegionSpec, ...]
    kept: int
    cost: float


# ---------------------------------------------------------------------------------------------
# segments and candidate regions
# ---------------------------------------------------------------------------------------------

def _body(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def _path(n: torch.fx.Node) -> str:
    return getattr(n.meta.get(SOURCE), "module_path", "")


def block_prefix(paths: list[str]) -> str | None:
    """The module list holding the blocks: the ``X`` of ``X.<i>`` paths with the most indices."""
    indices: dict[str, set[str]] = {}
    for p in paths:
        parts = p.split(".")
        for i, part in enumerate(parts[1:], 1):
            if part.isdigit():
                indices.setdefault(".".join(parts[:i]), set()).add(part)
    if not indices:
        return None
    return max(indices, key=lambda k: (len(indices[k]), -len(k)))


def find_segments(gm: torch.fx.GraphModule) -> list[Segment]:
    """The stem, the blocks (in order) and the head; a graph without a layer list is one block."""
    nodes = _body(gm)
    prefix = block_prefix([_path(n) for n in nodes])
    spans: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        path = _path(n)
        index = path[len(prefix) + 1:].split(".")[0] if prefix and path.startswith(prefix + ".") else ""
        if index.isdigit():
            spans.setdefault(f"{prefix}.{index}", []).append(i)
    if not spans:
        return [Segment("body", "block", tuple(nodes))]
    bounds = sorted((min(v), max(v), k) for k, v in spans.items())
    if any(a[1] >= b[0] for a, b in zip(bounds, bounds[1:])):  # interleaved blocks: plan as one
        return [Segment("body", "block", tuple(nodes))]
    segs = [Segment("stem", "stem", tuple(nodes[:bounds[0][0]]))]
    segs += [Segment(name, "block", tuple(nodes[lo:hi + 1])) for lo, hi, name in bounds]
    segs.append(Segment("head", "head", tuple(nodes[bounds[-1][1] + 1:])))
    return [s for s in segs if s.nodes]


def _members(nodes) -> list[torch.fx.Node]:
    """The nodes a region recomputes: not parameter reads (copied in), not reads of an outside
    op's outputs (those stay outside and come in as tensors)."""
    inside = set(nodes)
    out = []
    for n in nodes:
        if n.op in ("get_attr", "placeholder", "output"):
            continue
        if n.op == "call_function" and n.target is operator.getitem and n.args[0] not in inside:
            continue
        out.append(n)
    return out


def region_from(name: str, nodes, kind: str, segment: str) -> RegionSpec | None:
    """The region recomputing ``nodes`` (a run of consecutive graph nodes), None if it computes nothing."""
    members = _members(nodes)
    if not any(n.op in ("call_function", "call_method", "call_module") for n in members):
        return None
    inside = set(members)
    inputs = dict.fromkeys(a.name for n in members for a in n.all_input_nodes
                           if a not in inside and a.op != "get_attr")
    return RegionSpec(name=name, nodes=tuple(n.name for n in members), inputs=tuple(inputs), kind=kind,
                      segment=segment)


def communicates(n: torch.fx.Node) -> bool:
    """Whether ``n`` is a collective that communicates in its forward (never recomputed).
    ``grad_all_reduce`` (identity forward) and ``shard_slice`` (a local slice) may be recomputed:
    their backward collectives run once, in autograd's backward, recomputed or not."""
    from mambac.runtime.context_parallel import CP_FORMS  # context-parallel ops exchange state in forward
    return collective_name(n) in FORWARD_COMM or (n.op == "call_function" and n.target in CP_FORMS)


def split_runs(nodes, cut) -> list[list[torch.fx.Node]]:
    """Maximal runs of consecutive ``nodes`` (hence convex) without a node for which ``cut`` holds."""
    runs, cur = [], []
    for n in nodes:
        if cut(n):
            runs.append(cur)
            cur = []
        else:
            cur.append(n)
    runs.append(cur)
    return [r for r in runs if r]


def cheap_runs(gm: torch.fx.GraphModule, seg: Segment) -> list[list[torch.fx.Node]]:
    """Maximal runs of the segment's nodes between matrix products and collectives."""
    return split_runs(seg.nodes, lambda n: is_matmul(gm, n) or communicates(n))


def whole_regions(seg: Segment) -> tuple[RegionSpec, ...]:
    """The segment recomputed whole: one region, or one per run between forward collectives."""
    runs = split_runs(seg.nodes, communicates)
    names = [f"remat_{seg.tag}"] if len(runs) == 1 else [f"remat_{seg.tag}_part{i}" for i in range(len(runs))]
    regions = (region_from(name, run, "full", seg.name) for name, run in zip(names, runs))
    return tuple(r for r in regions if r is not None)


# ---------------------------------------------------------------------------------------------
# options and the knapsack
# ---------------------------------------------------------------------------------------------

def _pareto(options: list[Option]) -> list[Option]:
    """Options no other one beats on both bytes kept and cost (sorted by bytes kept)."""
    out: list[Option] = []
    for o in sorted(options, key=lambda o: (o.kept, o.cost)):
        if not out or o.cost < out[-1].cost:
            out.append(o)
    return out


def segment_options(gm: torch.fx.GraphModule, model: MemoryModel, seg: Segment) -> list[Option]:
    """Nothing, growing sets of cheap regions, the whole segment: each with its exact bytes kept
    (storages the segment's nodes allocated) and recompute cost."""
    mine = {n.name for n in seg.nodes}

    def option(regions) -> Option:
        kept = sum(s.nbytes for s in model.kept(regions) if s.producer in mine)
        return Option(tuple(regions), kept, model.cost(n for r in regions for n in r.nodes))

    none = option(())
    cheap = [region_from(f"remat_{seg.tag}_run{i}", run, "cheap", seg.name)
             for i, run in enumerate(cheap_runs(gm, seg))]
    gains = {r.name: (none.kept - option([r]).kept, model.cost(r.nodes)) for r in cheap if r is not None}
    ladder = sorted((r for r in cheap if r is not None and gains[r.name][0] > 0),
                    key=lambda r: gains[r.name][1] / gains[r.name][0])
    options = [none] + [option(ladder[:k]) for k in range(1, len(ladder) + 1)]
    whole = whole_regions(seg)
    if whole:
        options.append(option(whole))
    return _pareto(options)


def knapsack(per_segment: list[list[Option]]) -> list[tuple[int, float, tuple[Option, ...]]]:
    """The Pareto front of whole plans (one option per segment): (bytes kept, cost, choice)."""
    front: list[tuple[int, float, tuple[Option, ...]]] = [(0, 0.0, ())]
    for options in per_segment:
        merged = sorted(((k + o.kept, c + o.cost, ch + (o,)) for k, c, ch in front for o in options),
                        key=lambda t: (t[0], t[1]))
        front = []
        for item in merged:
            if not front or item[1] < front[-1][1]:
                front.append(item)
    return front


def _regions(choice) -> tuple[RegionSpec, ...]:
    return tuple(r for o in choice for r in o.regions)


STEP_PARTS = ("this rank's parameters, their gradients, AdamW's moments and the loss's backward workspace "
              "(with cuda_graphs=True, and the graphs' static gradient buffers)")
ADAMW_STATE_BYTES = 8   # per trainable parameter element: AdamW's two fp32 moments


def gradient_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of one gradient per trainable parameter of this rank (same dtype; tied weights once).
    With ``cuda_graphs=True`` a step holds them twice: the backward graph's static buffers in the
    graphs' pool, and the ``.grad`` tensors autograd copies them into."""
    return sum(p.numel() * p.element_size() for p in gm.parameters() if p.requires_grad)


def training_state_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes of this rank's parameters, their gradients and AdamW's moments (what
    ``memory_budget_scope='step'`` counts besides the saved activations)."""
    trainable = sum(p.numel() for p in gm.parameters() if p.requires_grad)   # each tensor once
    return sum(p.numel() * p.element_size() for p in gm.parameters()) + gradient_bytes(gm) \
        + trainable * ADAMW_STATE_BYTES


def loss_workspace_bytes(gm: torch.fx.GraphModule) -> int:
    """Bytes the loss's backward holds besides the saved activations, at the start of backward
    when they all still live: for the fused ``linear_cross_entropy``, the fp32 accumulator of the
    head's weight gradient, one chunk's logits in the compute dtype and the hidden states'
    gradient (the most of any such node).  What ``memory_budget_scope='step'`` reserves for it."""
    from mambac.ops._common import autocast_dtype
    from mambac.ops.linear_cross_entropy import default_chunk, linear_cross_entropy
    most = 0
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not linear_cross_entropy:
            continue
        hidden, weight = (a.meta.get(VAL) if isinstance(a, torch.fx.Node) else None for a in n.args[:2])
        if not (isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor)):
            continue
        tokens, d = (size_hint(s) for s in hidden.shape)
        vocab = size_hint(weight.shape[0])
        chunk = n.args[4] if len(n.args) > 4 and n.args[4] is not None else default_chunk(vocab)
        compute = autocast_dtype(hidden.device.type) or weight.dtype
        most = max(most, vocab * d * 4 + min(chunk, tokens) * vocab * compute.itemsize + tokens * d * hidden.itemsize)
    return most


def step_state_bytes(gm: torch.fx.GraphModule, cuda_graphs: bool = False) -> int:
    """What ``memory_budget_scope='step'`` takes off the budget before the saved activations."""
    return training_state_bytes(gm) + loss_workspace_bytes(gm) + (gradient_bytes(gm) if cuda_graphs else 0)


def _too_small(budget: int, minimum: int, model: MemoryModel, fixed: int = 0) -> MambacOptionsError:
    b, l = model.example
    step = (f" (memory_budget_scope='step': {fixed} bytes ({human(fixed)}) of it go to "
            f"{STEP_PARTS})") if fixed else ""
    return MambacOptionsError(
        f"memory_budget={budget + fixed} bytes ({human(budget + fixed)}) cannot be met for this program at B={b}, "
        f"L={l}{step}: even with every block and the head recomputed, autograd keeps {minimum} bytes "
        f"({human(minimum)}) for backward. Set memory_budget to at least {minimum + fixed}, or lower the batch size "
        "or sequence length.")


def choose_auto(gm: torch.fx.GraphModule, model: MemoryModel, budget: int | None,
                fixed: int = 0) -> tuple[tuple[RegionSpec, ...], int]:
    """The cheapest plan under ``budget`` (without one: every cheap region, no matmul recomputed),
    and the least any plan keeps."""
    per_segment = [segment_options(gm, model, s) for s in find_segments(gm)]
    minimum = model.predict(_regions(min(opts, key=lambda o: o.kept) for opts in per_segment))
    if budget is None:
        cheap = [min((o for o in opts if all(r.kind == "cheap" for r in o.regions)), key=lambda o: o.kept)
                 for opts in per_segment]
        return _regions(cheap), minimum
    if minimum > budget:
        raise _too_small(budget, minimum, model, fixed)
    for _, _, choice in sorted(knapsack(per_segment), key=lambda t: (t[1], t[0])):
        regions = _regions(choice)
        if model.predict(regions) <= budget:  # exact check: savings need not add up across segments
            return regions, minimum
    return _regions(min(opts, key=lambda o: o.kept) for opts in per_segment), minimum


def choose_full(gm: torch.fx.GraphModule) -> tuple[RegionSpec, ...]:
    """Every residual block recomputed whole (split at its forward collectives)."""
    return tuple(r for s in find_segments(gm) if s.kind == "block" for r in whole_regions(s))


def install(gm: torch.fx.GraphModule, plan: RematPlan, ctx: PassContext) -> None:
    """Put ``plan``'s regions into ``gm``, leave the plan in ``gm.meta[MEMORY_PLAN]`` and count it."""
    apply_plan(gm, plan, ctx.verify)
    gm.meta[MEMORY_PLAN] = plan
    stats = ctx.stats_for(NAME)
    stats.add("regions", len(plan.regions))
    stats.add("recomputed_nodes", sum(len(r.nodes) for r in plan.regions))
    stats.add("saved_bytes_without", plan.baseline)
    stats.add("saved_bytes_predicted", plan.predicted)
    gm.recompile()


def checkpoint_modules(gm: torch.fx.GraphModule, paths: list[str], ctx: PassContext) -> str:
    """Recompute each submodule the model itself checkpoints (``torch.utils.checkpoint`` calls,
    traced through by capture; ``paths`` in call order) as one region, split at its forward
    collectives, as 'full' does for blocks.  Returns why it could not (nothing changed then), or
    an empty string once the regions are in."""
    nodes = _body(gm)
    segments = []
    if any(q.startswith(p + ".") for p in paths for q in paths):
        return "checkpointed modules nest"
    for path in dict.fromkeys(paths):
        at = [i for i, n in enumerate(nodes) if _path(n) == path or _path(n).startswith(path + ".")]
        if not at:
            return f"the checkpointed module '{path}' left no nodes in the lowered graph"
        if at != list(range(at[0], at[-1] + 1)):
            return f"the nodes of the checkpointed module '{path}' are interleaved with others"
        segments.append(Segment(path, "block", tuple(nodes[at[0]:at[-1] + 1])))
    regions = tuple(r for seg in segments for r in whole_regions(seg))
    model = analyse(gm)
    install(gm, RematPlan(mode="checkpoint", budget=None, regions=regions, model=model, baseline=model.predict(),
                          predicted=model.predict(regions), minimum=None), ctx)
    return ""


# ---------------------------------------------------------------------------------------------
# the pass
# ---------------------------------------------------------------------------------------------

def make_plan(gm: torch.fx.GraphModule, mode: str, budget: int | None, fixed: int = 0) -> RematPlan:
    """Analyse ``gm`` and choose its regions (does not change the graph); ``budget`` is what the
    saved activations may keep, ``fixed`` what the budget's scope spent before them."""
    model = analyse(gm)
    if mode == "none":
        regions, minimum = (), None
    elif mode == "full":
        regions, minimum = choose_full(gm), None
    else:
        regions, minimum = choose_auto(gm, model, budget, fixed)
    return RematPlan(mode=mode, budget=budget, regions=regions, model=model, baseline=model.predict(),
                     predicted=model.predict(regions), minimum=minimum, fixed=fixed)


def apply_plan(gm: torch.fx.GraphModule, plan: RematPlan, verify: bool = False) -> None:
    """Replace each region's nodes by one ``remat_*`` call of its checkpointed sub-graph (and run
    the verifier on each sub-graph when ``verify``: the runner only sees the outer graph)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for spec in plan.regions:
        nodes = [by_name[n] for n in spec.nodes]
        for n in nodes:
            n.meta[REMAT] = RematTag(spec.name)
        members = set(nodes)
        placements = [n.meta.get(PLACEMENT) for n in nodes if any(u not in members for u in n.users)]
        call = collapse_region(gm, nodes, spec.name, lambda body, s=spec: RematRegion(body, s), created_by=NAME)
        for read in call.users:  # the region's outputs keep their placements (per-rank graphs)
            if placements[read.args[1]] is not None:
                read.meta[PLACEMENT] = placements[read.args[1]]
        if spec.segment not in ("stem", "head", "body"):
            for n in (call, *call.users):
                n.meta[SOURCE] = SourceInfo(spec.segment, "RematRegion", NAME)
        if verify:
            check_graph(gm.get_submodule(spec.name).body, f"{NAME}:{spec.name}")


def activation_budget(gm: torch.fx.GraphModule, opts) -> tuple[int | None, int]:
    """(bytes the saved activations may keep, bytes the budget's scope spends before them)."""
    budget = getattr(opts, "memory_budget", None)
    if budget is None or getattr(opts, "memory_budget_scope", "activations") != "step":
        return budget, 0
    fixed = step_state_bytes(gm, bool(getattr(opts, "cuda_graphs", False)))
    if fixed >= budget:
        raise MambacOptionsError(
            f"memory_budget={budget} bytes ({human(budget)}) with memory_budget_scope='step' leaves nothing for "
            f"activations: {STEP_PARTS} alone take {fixed} bytes "
            f"({human(fixed)}). Raise memory_budget, shard the model over more ranks (tp), or use "
            "memory_budget_scope='activations' to budget the saved activations alone.")
    return budget - fixed, fixed


def pin_example_sizes(gm: torch.fx.GraphModule) -> None:
    """Make the graph's symbolic input sizes (``torch.compile`` with dynamic shapes) the example's:
    a plan chosen to meet a budget holds at the sizes it was chosen for, so the compiled graph
    must only run at those (each new batch size or length is lowered and planned again).  'full',
    and 'auto' without a budget, recompute the same regions at any size and stay dynamic."""
    for n in gm.graph.nodes:
        v = n.meta.get(VAL)
        if n.op == "placeholder" and isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    int(s)  # guards the size to its example value


def plan_remat(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Plan and insert recompute regions for ``ctx.options.remat`` ('none' leaves ``gm`` as it is)."""
    opts = ctx.options
    mode = getattr(opts, "remat", "none")
    if mode == "none":
        return gm
    budget, fixed = activation_budget(gm, opts)
    if mode == "auto" and budget is not None:
        pin_example_sizes(gm)
    install(gm, make_plan(gm, mode, budget, fixed), ctx)
    return gm
