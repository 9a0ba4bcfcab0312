"""``torch.compile(model, backend="mambac", options={...})``: mambac as a TorchDynamo backend.

Dynamo captures each region of Python it can follow into a torch-level FX graph (the custom ops
``torch.ops.mambac.*`` are single nodes there; parameters are graph inputs) and hands it to this
backend with example inputs.  The backend gives every node its fake value (symbolic sizes
included), names the module each node came from, replaces transformers' Mamba / Mamba-2 mixers by
mambac's on the same parameters (``mambac.backend_foreign``), runs mambac's pass pipeline -- the same passes
``mambac.compile`` runs -- and hands the lowered graph to AOTAutograd, where each mambac op's backward is one opaque node
(``mambac::<op>_backward``); ``MambacBackend(trace_backward=False)`` returns the lowered graph's
forward instead, with autograd through the ops' own rules as under ``mambac.compile``.  Regions dynamo
cannot capture (graph breaks) run as plain Python, as they would without mambac.

On several ranks (``options={"world_size": W, "tp": ..., "cp": ...}``) the graph must be a model's
whole forward: each rank runs the program ``mambac.compile`` would lower for it, on shards of the
model's own parameters, whose gradients come back whole on every rank (``mambac.backend_parallel``).

The backend is registered through the ``torch_dynamo_backends`` entry point, so
``backend="mambac"`` works after ``pip install`` without importing mambac first.  Options are
``mambac.compile``'s, validated by ``CompileOptions.create``.  Every pass's counts land in
``torch._dynamo.utils.counters["mambac"]`` (``"fuse_ssm.dt_prologue"``, ...), next to ``"graphs"``
(backend calls) and ``"mixers.lowered"`` / ``"mixers.not_lowered"``.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.fx

from mambac.backend_foreign import swap_foreign_mixers, warn_if_gradient_checkpointing
from mambac.backend_regions import lower_regions
from mambac.backend_scalars import bake, guard_scalars
from mambac.dynamo_paths import dotted, qualname
from mambac.capture import propagate_shapes
from mambac.errors import MambacOptionsError
from mambac.ir import SOURCE, SourceInfo
from mambac.lowering import make_context
from mambac.ops._common import info_for_target
from mambac.options import CompileOptions
from mambac.passes.context import PassContext
from mambac.passes.pipeline import pipeline_for
from mambac.passes.runner import run_passes

log = logging.getLogger("mambac.backend")

COUNTERS_KEY = "mambac"
# Mixer classes of other libraries, recognised in a graph by their qualified name (their math is
# plain PyTorch, so nothing in them is fused; ``mambac.convert`` turns their models into mambac's).
FOREIGN_MIXERS = (
    "transformers.models.mamba.modeling_mamba.MambaMixer",
    "transformers.models.mamba2.modeling_mamba2.Mamba2Mixer",
    "mamba_ssm.modules.mamba_simple.Mamba",
    "mamba_ssm.modules.mamba2.Mamba2",
    "mamba_ssm.modules.mamba3.Mamba3",
)
MAMBAC_MIXERS = ("mambac.models.mamba1.Mamba", "mambac.models.mamba2.Mamba2", "mambac.models.mamba3.Mamba3")


@dataclass
class LoweredGraph:
    """One dynamo graph after mambac's passes: the graph and what the passes reported."""

    gm: torch.fx.GraphModule
    ctx: PassContext

    def text(self, stage: str = "") -> str:
        """The printed graph after ``stage`` (the last pass when empty)."""
        if not stage:
            return self.ctx.history[-1][1]
        for name, text in self.ctx.history:
            if name == stage:
                return text
        raise KeyError(f"no stage {stage!r}; stages: {[n for n, _ in self.ctx.history]}")


# -- module provenance -----------------------------------------------------------------------------

def _stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """(dotted module path, qualified class name) of every module around ``node``, outermost first."""
    return [(dotted(path), qualname(cls)) for path, cls in (node.meta.get("nn_module_stack") or {}).values()]


def annotate_sources(gm: torch.fx.GraphModule) -> None:
    """Record on every node the innermost module it came from (``meta[SOURCE]``), from dynamo's
    ``nn_module_stack``, so printed graphs and errors name modules as under ``mambac.compile``."""
    for node in gm.graph.nodes:
        stack = _stack(node)
        if stack and SOURCE not in node.meta:
            path, cls = stack[-1]
            node.meta[SOURCE] = SourceInfo(module_path=path, module_type=cls.rsplit(".", 1)[-1])


def _nodes_and_regions(gm: torch.fx.GraphModule, region: str | None = None):
    """(node, the sub-graph it is in, or None) for ``gm``'s nodes and those of the graphs it holds
    (the bodies of dynamo's higher-order ops, e.g. a ``torch.utils.checkpoint`` region), depth first."""
    for node in gm.graph.nodes:
        yield node, region
        if node.op == "get_attr":
            sub = getattr(gm, str(node.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                yield from _nodes_and_regions(sub, region or str(node.target))


def recognise_mixers(gm: torch.fx.GraphModule, ctx: PassContext,
                     lowered_regions: frozenset[str] | set[str] = frozenset()) -> dict[str, str]:
    """Find the Mamba mixers in ``gm`` by their module class and say which are lowered.

    A mixer is lowered when its nodes include mambac ops in ``gm`` itself: mambac's own mixers,
    and transformers' mixers that ``swap_foreign_mixers`` replaced by mambac's
    (``mambac.backend_foreign``); any other (mamba_ssm's, an HF mixer it could not replace, one
    inside a sub-graph not in ``lowered_regions``, e.g. a ``torch.utils.checkpoint`` body that
    ``backend_regions`` could not lower) runs unfused.  Returns path → class name; counts
    ``mixers.lowered`` / ``mixers.not_lowered`` in ``ctx.stats['backend']`` and logs what was
    missed with what to do.
    """
    found: dict[str, str] = {}
    lowered: set[str] = set()
    regions: set[str] = set()
    for node, region in _nodes_and_regions(gm):
        for path, cls in _stack(node):
            if cls in FOREIGN_MIXERS or cls in MAMBAC_MIXERS:
                found[path] = cls
                if region is not None:
                    regions.add(path)
                if ((region is None or region in lowered_regions) and node.op == "call_function"
                        and info_for_target(node.target) is not None):
                    lowered.add(path)
    stats = ctx.stats_for("backend")
    stats.add("mixers.lowered", len(lowered))
    stats.add("mixers.not_lowered", len(found) - len(lowered))
    _say_what_was_missed(found, [p for p in found if p not in lowered], regions)
    return found


def _say_what_was_missed(found: dict[str, str], missed: list[str], regions: set[str]) -> None:
    boxed = [p for p in missed if p in regions]
    foreign = sorted({found[p] for p in missed if p not in regions and found[p] in FOREIGN_MIXERS})
    own = [p for p in missed if p not in regions and found[p] in MAMBAC_MIXERS]
    if boxed:
        hf = (" (transformers' mixers as their own PyTorch code)"
              if any(found[p] in FOREIGN_MIXERS for p in boxed) else "")
        log.warning("mambac backend: %d mixer(s) (%s) sit inside torch.utils.checkpoint regions (gradient "
                    "checkpointing) whose sub-graphs were not lowered: they run unfused%s. Turn that checkpointing "
                    "off (transformers: model.gradient_checkpointing_disable()) and pass options={'remat': 'full'} "
                    "(or 'auto') for the same recompute, fused.",
                    len(boxed), ", ".join(boxed[:4]) + (", ..." if len(boxed) > 4 else ""), hf)
    if foreign:
        log.warning("mambac backend: %d mixer(s) of %s run as their own PyTorch code (nothing to fuse); "
                    "compile mambac.convert.convert(model) to lower them.",
                    sum(p not in regions and found[p] in FOREIGN_MIXERS for p in missed), ", ".join(foreign))
    if own:
        log.warning("mambac backend: %d mambac mixer(s) (%s) run unfused: their ops are not in this graph (a graph "
                    "break splits them off), so the passes do not reach them. Remove the graph break "
                    "(TORCH_LOGS=graph_breaks shows where).", len(own), ", ".join(own[:4]))


# -- lowering --------------------------------------------------------------------------------------

def _fake_mode_for(example_inputs: Sequence[Any]):
    """Dynamo's fake mode (from the tracing context, else from fake inputs; None for real inputs
    outside dynamo), so the fake values share dynamo's symbolic sizes."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode(list(example_inputs))


def _symbolic_contexts():
    """Dynamo's symbolic context of each input tensor it traced (None outside a dynamo trace)."""
    from torch._guards import TracingContext
    return getattr(TracingContext.try_get(), "tensor_to_context", None)


def _same_shape_env(value: Any, mode) -> bool:
    """Whether ``value`` is a fake tensor whose sizes live in ``mode``'s shape environment (dynamo
    hands a backend a fake mode of its own over the shape environment it traced with)."""
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(value, FakeTensor) and value.fake_mode.shape_env is mode.shape_env


def _dynamo_fakes(example_inputs: Sequence[Any], mode, gm: torch.fx.GraphModule | None = None) -> list:
    """The inputs to propagate: each real data tensor fakified with the symbolic context dynamo
    traced it with (``TracingContext.tensor_to_context``, as AOTAutograd does), so its fake has
    dynamo's own size symbols; where dynamo holds no context for the tensor, the fake dynamo traced
    its placeholder with (``example_value``, same fake mode); the rest as given.  Fakified without
    either, a tensor gets sizes of its own, and an op relating it to dynamo's tensors (the loss's
    labels and logits) pins the length.  (The pinning seen with torch 2.11 had another cause,
    handled by ``mambac.capture.symbolic_dispatch``.)"""
    from torch._subclasses.fake_tensor import FakeTensor
    contexts = _symbolic_contexts()
    out = list(example_inputs)
    if mode is None:
        return out
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"] if gm is not None else []
    traced = [n.meta.get("example_value") for n in holders] if len(holders) == len(out) else [None] * len(out)
    for i, t in enumerate(out):
        if not isinstance(t, torch.Tensor) or isinstance(t, (torch.nn.Parameter, FakeTensor)):
            continue
        if contexts is not None and t in contexts:
            context = contexts[t]
            out[i] = mode.from_tensor(t, symbolic_context=context, source=context.tensor_source)
        elif _same_shape_env(traced[i], mode) and traced[i].dim() == t.dim() and traced[i].dtype == t.dtype:
            # (dims and dtype compared, not sizes: that would guard on them)
            out[i] = traced[i] if traced[i].fake_mode is mode else mode.from_tensor(traced[i])
    return out


@contextlib.contextmanager
def _real_constants_allowed(mode):
    """Let ``mode`` take the real tensors that ``get_attr`` nodes read (the parameters of a graph
    made by ``torch.fx.symbolic_trace``; dynamo lifts them to inputs) for the time of one
    propagation; a mode that already allows them is left alone."""
    before = getattr(mode, "allow_non_fake_inputs", True)
    if mode is not None:
        mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        if mode is not None:
            mode.allow_non_fake_inputs = before


def lower_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: CompileOptions) -> LoweredGraph:
    """Give ``gm``'s nodes fake values from ``example_inputs`` (real or fake tensors, ints or
    SymInts) and run the pass pipeline for ``options`` on it."""
    annotate_sources(gm)
    warn_if_gradient_checkpointing()
    mode = _fake_mode_for(example_inputs)
    inputs = _dynamo_fakes(example_inputs, mode, gm)
    with _real_constants_allowed(mode):
        propagate_shapes(gm, inputs, mode)
        if options.world_size == 1 and swap_foreign_mixers(gm, example_inputs):
            propagate_shapes(gm, inputs, mode)  # the swapped-in mixers' nodes
    ctx = _context(options)
    regions = lower_regions(gm, mode, ctx) if options.world_size == 1 else set()   # checkpoint bodies
    recognise_mixers(gm, ctx, regions)  # before the passes: remat moves op nodes into sub-graphs
    gm = run_passes(gm, ctx, pipeline_for(options))
    _count(ctx)
    return LoweredGraph(gm=gm, ctx=ctx)


def _context(options: CompileOptions) -> PassContext:
    """``mambac.compile``'s pass context; dumps go to one sub-folder per dynamo graph
    (``dynamo_graph_000``, ...), as a graph break gives several graphs."""
    from torch._dynamo.utils import counters

    ctx = make_context(options)
    if ctx.dump_dir:
        ctx.dump_dir = str(Path(ctx.dump_dir) / f"dynamo_graph_{counters[COUNTERS_KEY]['graphs']:03d}")
    return ctx


def _count(ctx: PassContext) -> None:
    from torch._dynamo.utils import counters

    bucket = counters[COUNTERS_KEY]
    bucket["graphs"] += 1
    for pass_name, stats in ctx.stats.items():
        for key, n in stats.counts.items():
            bucket[key if pass_name == "backend" else f"{pass_name}.{key}"] += n


# -- AOTAutograd (opt-in) --------------------------------------------------------------------------

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _views_to_reshapes(gm: torch.fx.GraphModule) -> int:
    """Turn every ``view`` of an AOTAutograd graph into ``reshape``; returns how many.

    AOTAutograd traces with fake tensors and picks ``view`` wherever the *fake* strides allow it.
    Fake and real strides can disagree (a fake function answering ``empty_like`` of a transposed
    input where the kernel returns a contiguous tensor; a decomposition ordering an elementwise
    result's dims differently from the kernel), and the ``view`` then fails at run time.  These
    graphs are functional (AOTAutograd removed every mutation), so nothing depends on a view
    aliasing its input, and ``reshape`` -- a view where the strides allow it, a copy otherwise --
    computes the same values for any strides.
    """
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = torch.ops.aten.reshape.default
            n += 1
    if n:
        gm.recompile()
    return n


def _run_as_traced(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """AOTAutograd's forward and backward compiler: run the traced graph as it is."""
    from functorch.compile import make_boxed_func

    _views_to_reshapes(gm)
    return make_boxed_func(gm.forward)


def _returns_tuple(gm: torch.fx.GraphModule) -> bool:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return isinstance(out.args[0], (tuple, list))


def _with_aot_autograd(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_run_as_traced, bw_compiler=_run_as_traced)(gm, example_inputs)


# -- the backend -----------------------------------------------------------------------------------

class MambacBackend:
    """A dynamo backend with fixed mambac options that keeps every graph it lowered (``graphs``).

    ``torch.compile(model, backend=MambacBackend(**options))`` is
    ``torch.compile(model, backend="mambac", options=options)`` plus the record.  On one rank the
    lowered graph goes through AOTAutograd (``trace_backward``, default on; off: it runs as it is,
    autograd through the ops' own rules).  With
    ``world_size > 1`` the process group is checked (and the mesh made) here, before any graph,
    and ``graphs`` holds this rank's lowered programs.
    """

    def __init__(self, *, trace_backward: bool | None = None, **options: Any) -> None:
        self.options = CompileOptions.create(**options)
        if self.options.cuda_graphs:
            raise MambacOptionsError(
                "cuda_graphs=True is not supported by the torch.compile backend: dynamo hands mambac pieces of the "
                "model between graph breaks, and guards and Python run between them on every call. Use "
                "mambac.compile(model, cuda_graphs=True) to replay the whole compiled model as CUDA graphs.")
        self.mesh = None
        if self.options.world_size > 1:
            from mambac.backend_parallel import check_parallel_options, parallel_mesh
            check_parallel_options(self.options)
            if trace_backward:
                raise MambacOptionsError("trace_backward=True runs on one rank only; drop it for world_size > 1.")
            trace_backward = False
            self.mesh = parallel_mesh(self.options)
        self.trace_backward = True if trace_backward is None else bool(trace_backward)
        self.graphs: list[LoweredGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        _reject_extra_arguments(kwargs)
        baked, traced = bake(gm, example_inputs)   # dynamic=True's unspecialised floats (backend_scalars.py)
        compiled = self._compile(gm, example_inputs)
        return guard_scalars(compiled, traced, baked) if baked else compiled

    def _compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        if self.mesh is not None:
            return self._parallel(gm, example_inputs)
        lowered = lower_graph(gm, example_inputs, self.options)
        self.graphs.append(lowered)
        if self.trace_backward and _returns_tuple(lowered.gm):  # dynamo's graphs do; hand-made ones may not
            return _with_aot_autograd(lowered.gm, example_inputs)
        return lowered.gm.forward

    def _parallel(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        """This rank's program for the model behind ``gm`` (mambac/backend_parallel.py), lowered now
        for the example inputs so errors surface at the first call."""
        from mambac.backend_parallel import ParallelGraph, whole_forward
        try:
            frame = whole_forward(gm, example_inputs)
        except MambacOptionsError as why:  # a piece between graph breaks, or not a module's forward
            return self._replicated(gm, example_inputs, why)
        dump = _context(self.options).dump_dir
        run = ParallelGraph(frame, self.options, self.mesh, dump)
        program, _ = run.program(list(frame.values))
        recognise_mixers(gm, program.ctx)
        _count(program.ctx)
        self.graphs.append(LoweredGraph(gm=program.gm, ctx=program.ctx))
        return run


    def _replicated(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], why: Exception) -> Callable:
        """A graph that is not a model's whole forward cannot be split over the ranks: every rank runs
        it whole, lowered as on one rank, which gives eager's values and gradients on every rank."""
        import warnings
        msg = (f"mambac: this graph runs unsplit on every rank (no tensor or context parallelism for it): {why} "
               "Its values and gradients are eager's.")
        warnings.warn(msg, stacklevel=2)
        log.warning(msg)
        from torch._dynamo.utils import counters
        counters[COUNTERS_KEY]["graphs.replicated"] += 1
        from mambac.backend_parallel import replicated_options
        lowered = lower_graph(gm, example_inputs, replicated_options(self.options))
        self.graphs.append(lowered)
        return lowered.gm.forward


def _reject_extra_arguments(kwargs: dict) -> None:
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        raise MambacOptionsError(f"torch.compile(mode={mode!r}) selects inductor settings; the mambac backend has "
                                 "no modes. Drop mode= and pass mambac's options as options={...}.")
    if kwargs:
        raise MambacOptionsError(f"the mambac backend got unexpected arguments {sorted(kwargs)}; pass mambac's "
                                 "options as torch.compile(..., options={...}).")


def mambac_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None,
                   **kwargs: Any) -> Callable:
    """The ``"mambac"`` dynamo backend: validate ``options`` (those of ``mambac.compile``) and
    lower ``gm`` through mambac's passes; the returned graph runs the ops' own autograd rules."""
    if options is not None and not isinstance(options, dict):
        raise MambacOptionsError(f"options must be a dict of mambac.compile options, got {type(options).__name__}.")
    CompileOptions.create(**(options or {}))  # exactly mambac.compile's options (no backend-only ones)
    return MambacBackend(**(options or {}))(gm, example_inputs, **kwargs)
