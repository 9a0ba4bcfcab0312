"""Several ranks under ``torch.compile(model, backend="mambac", options={"world_size": W, ...})``.

Every rank runs the same full model (same weights) on the same full inputs.  A dynamo graph has
the full model's sizes baked into its reshapes and splits, so a rank's program cannot be cut out of
it; instead the backend takes the model the graph was captured from (``L['self']`` of the frame
dynamo compiled) and lowers this rank's program from the rank's local model exactly as
``mambac.compile`` does (``mambac.lowering.rank_setup`` / ``lower``: the tensor-parallel passes,
then ``split_sequence`` under cp).  That needs the graph to be the model's whole ``forward``.  A
graph that is not (a piece between graph breaks, a function that is not a module's forward) runs
whole on every rank, lowered as on one rank (``replicated_options``), with a warning that says
why: its values and gradients are eager's, but its work is not split.

The program does not train the local model's copies.  At every call this rank's shards are cut
from the model's own (full) parameters by one autograd function, ``_TakeShards``, and swapped into
the program (``torch.func.functional_call``).  Its backward rebuilds every full gradient from the
shards' gradients with one all-reduce over all ranks: each rank scatters the entries it owns into a
zero tensor of the full shape (its split segments; replicated parts on tp rank 0 only, because the
passes leave replicated gradients identical on every tp rank), and the sum over the cp ranks adds
up the partial gradients of the sequence pieces.  So after ``loss.backward()`` every rank holds the
eager (single-process) gradients on the model's parameters, and an ordinary optimizer step keeps
the ranks in sync.  Under cp, an input that requires grad is cut into this rank's piece by
``_SequencePiece``, whose backward sums the pieces' gradients over the cp ranks, so its gradient
is whole on every rank too.  Data parallelism is refused: each rank would need its own batch.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch.utils import _pytree as pytree

from mambac.errors import MambacOptionsError, MambacRuntimeError
from mambac.lowering import Lowered, lower, rank_setup, signature_of
from mambac.options import CompileOptions
from mambac.sharding_plan import ParamLayout

# options whose multi-rank meaning the backend does not offer (name -> allowed value, why)
_FIXED = {
    "dp": (1, "data parallelism gives each replica its own part of the batch, but under torch.compile every "
              "rank runs the whole model on the whole batch. Use mambac.compile(model, world_size=..., dp=...), or "
              "wrap the compiled model in DistributedDataParallel over its own process group."),
    "output": ("full", "the backend returns what the model returns, whole, on every rank."),
    "cp_inputs": ("full", "every rank passes the whole sequence to the model under torch.compile."),
    "cuda_graphs": (False, "the backend runs this rank's program as it is; use mambac.compile(model, world_size=..., "
                           "cuda_graphs=True) to replay CUDA graphs."),
}


def check_parallel_options(options: CompileOptions) -> None:
    """Refuse the layouts the backend does not run on several ranks, before anything else happens."""
    for name, (allowed, why) in _FIXED.items():
        if getattr(options, name, allowed) != allowed:
            raise MambacOptionsError(f"{name}={getattr(options, name)!r} is not supported by the torch.compile "
                                     f"backend on several ranks: {why}")


def parallel_mesh(options: CompileOptions):
    """This process's mesh for ``options``, from the process group the launcher (or the user)
    started; a missing group or one of another size is a clear error, raised before anything is
    lowered.  Meshes are made once per process group and layout (their sub-groups are collective
    to create, and the backend is called once per dynamo graph)."""
    from mambac.runtime.mesh import init_distributed, launch_hint, launched, make_mesh
    if not dist.is_initialized():
        if not launched():
            raise MambacRuntimeError(
                f"options world_size={options.world_size} needs a torch.distributed process group, and none is "
                "initialised (nor is there a launcher environment to start one from); "
                f"{launch_hint(options.world_size)} -- here torch.compile(model, backend='mambac', "
                f"options={{'world_size': {options.world_size}, ...}}).")
        init_distributed(options.comm_timeout)
    if dist.get_world_size() != options.world_size:
        raise MambacRuntimeError(
            f"options world_size={options.world_size} but the process group has {dist.get_world_size()} ranks; "
            f"pass world_size={dist.get_world_size()} (or launch {options.world_size} processes).")
    key = (options.tp, options.cp, options.sequence_parallel, id(dist.distributed_c10d._get_default_group()))
    if key not in _MESHES:
        _MESHES[key] = make_mesh(options)
    return _MESHES[key]


_MESHES: dict[tuple, Any] = {}


# -- the model behind a dynamo graph ---------------------------------------------------------------

@dataclass
class WholeForward:
    """A dynamo graph that is one model's whole ``forward``: the model, the forward's bound values
    at compile time, and where each tensor value and parameter arrives among the graph's inputs."""

    model: torch.nn.Module
    values: list[Any]               # bound forward arguments (compile-time values)
    value_slots: list[int | None]   # graph input index of each value (None: a constant dynamo guards)
    param_slots: dict[int, int]     # id(full parameter) -> graph input index
    n_outputs: int


def replicated_options(options):
    """``options`` for a graph every rank runs whole: one rank's layout, the rest unchanged."""
    return dataclasses.replace(options, world_size=1, tp=1, dp=1, cp=1, sequence_parallel=False, plan=())


def _source_name(node: torch.fx.Node) -> str:
    arg = node.meta.get("grapharg")
    return arg.source.name if arg is not None and getattr(arg, "source", None) is not None else ""


def whole_forward(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> WholeForward:
    """The model and inputs behind ``gm``, or a ``MambacOptionsError`` saying why the graph is not a
    whole ``forward`` (a graph break, a function that is not a module's forward, ...)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and reason.graph_break:
        where = reason.user_stack[-1] if reason.user_stack else None
        at = f" at {where.filename}:{where.lineno}" if where is not None else ""
        raise MambacOptionsError(
            f"on several ranks the mambac backend needs the model's whole forward as one graph, but dynamo broke "
            f"the graph{at} ({reason.reason.strip().splitlines()[0]}). Remove the graph break, or use "
            "mambac.compile(model, world_size=...).")
    tx = _current_frame()
    model = tx.f_locals.get("self") if tx is not None else None
    forward = getattr(type(model), "forward", None)
    if not isinstance(model, torch.nn.Module) or getattr(forward, "__code__", None) is not tx.f_code:
        raise MambacOptionsError(
            "on several ranks the mambac backend compiles an nn.Module's whole forward (torch.compile(model, "
            "backend='mambac', ...)); this graph comes from another function. Compile the model itself, or use "
            "mambac.compile(model, world_size=...).")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_source = {_source_name(n): i for i, n in enumerate(placeholders)}
    params = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    buffers = {id(b) for b in model.buffers()}
    param_slots = {}
    for i, (node, ex) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(ex, torch.nn.Parameter) and id(ex) in params:
            param_slots[id(ex)] = i
        elif (isinstance(ex, torch.Tensor) and node.users   # (a number baked by backend_scalars: no reads left)
              and not _source_name(node).startswith("L[") and id(ex) not in buffers):
            raise MambacOptionsError(f"graph input '{node.name}' ({_source_name(node) or 'no source'}) is neither "
                                     f"an argument of {type(model).__name__}.forward nor one of its parameters; on "
                                     "several ranks the mambac backend lowers the model's forward alone.")
    sig = inspect.signature(forward)
    names = [n for n in sig.parameters if n != "self"]
    if any(sig.parameters[n].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for n in names):
        raise MambacOptionsError(f"{type(model).__name__}.forward takes *args/**kwargs; on several ranks the mambac "
                                 "backend needs named forward parameters.")
    values = [tx.f_locals.get(n) for n in names]
    slots = [by_source.get(f"L['{n}']") if isinstance(v, torch.Tensor) else None for n, v in zip(names, values)]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return WholeForward(model=model, values=values, value_slots=slots, param_slots=param_slots,
                        n_outputs=len(pytree.tree_leaves(output.args[0])))


def _current_frame():
    """The frame dynamo is compiling (its locals hold the module as ``self``), or None outside dynamo."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        return InstructionTranslator.current_tx()
    except (ImportError, AttributeError):
        return None


# -- shards of the full parameters -----------------------------------------------------------------

@dataclass(frozen=True)
class _ShardSpec:
    """How one full parameter becomes this rank's tensor (its shard, or a copy of it when it is
    replicated) and which entries of its gradient this rank contributes to the all-reduce."""

    layout: ParamLayout | None
    owned: tuple[int, ...] | None = None     # local entries along layout.dim this rank contributes
    index: tuple[int, ...] | None = None     # their indices in the full tensor


class _TakeShards(torch.autograd.Function):
    """Forward: this rank's shard of every full parameter.  Backward: every full gradient, summed
    over the ranks in one flat all-reduce (see the module docstring)."""

    @staticmethod
    def forward(ctx, specs: tuple[_ShardSpec, ...], tp_rank: int, *fulls: torch.Tensor):
        ctx.specs, ctx.tp_rank = specs, tp_rank
        ctx.shapes = [f.shape for f in fulls]
        out = []
        for spec, full in zip(specs, fulls):
            out.append(spec.layout.local(full) if spec.layout is not None else full.clone())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        fulls: list[torch.Tensor | None] = []
        reduced = []
        for spec, shape, g in zip(ctx.specs, ctx.shapes, grads):
            if spec.layout is None:  # replicated: identical over tp, partial over cp
                full = g.clone() if ctx.tp_rank == 0 else torch.zeros_like(g)
            else:
                full = g.new_zeros(shape)
                dim = spec.layout.dim
                owned = torch.tensor(spec.owned, dtype=torch.long, device=g.device)
                index = torch.tensor(spec.index, dtype=torch.long, device=g.device)
                full.index_copy_(dim, index, g.index_select(dim, owned))
            fulls.append(full)
            reduced.append(full)
        _all_reduce_flat(reduced)
        return (None, None, *fulls)


def _all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` over all ranks in place: one all-reduce per dtype, in a fixed order."""
    from mambac.runtime.collectives import _run
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, group in by_dtype.items():
        flat = torch.cat([t.reshape(-1) for t in group])
        _run("all_reduce (parameter gradients)", "default", dist.get_rank(), lambda: dist.all_reduce(flat))
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class _SequencePiece(torch.autograd.Function):
    """Forward: this cp rank's piece of a whole sequence input (along dim 1).  Backward: the whole
    input's gradient on every rank, the pieces' gradients summed over the cp ranks."""

    @staticmethod
    def forward(ctx, whole: torch.Tensor, cp_rank: int, cp: int, group) -> torch.Tensor:
        from mambac.runtime.collectives import split_start
        from mambac.runtime.context_parallel import local_piece
        ctx.shape, ctx.group = whole.shape, group
        ctx.start = split_start(whole.shape[1], cp, cp_rank)
        return local_piece(whole, 1, cp_rank, cp).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from mambac.runtime.collectives import _run
        full = grad.new_zeros(ctx.shape)
        full.narrow(1, ctx.start, grad.shape[1]).copy_(grad)
        _run("all_reduce (input gradients)", "cp", dist.get_rank(), lambda: dist.all_reduce(full, group=ctx.group))
        return full, None, None, None


# -- the per-rank program ---------------------------------------------------------------------------

class ParallelGraph:
    """What the backend returns for one dynamo graph on several ranks: called with the graph's
    inputs, it runs this rank's lowered program on shards of the full parameters and returns the
    graph's outputs (whole, as in eager)."""

    def __init__(self, frame: WholeForward, options: CompileOptions, mesh, dump_dir: str | None) -> None:
        from mambac.runtime.compiled_module import check_same_config
        self.frame, self.options, self.mesh = frame, options, mesh
        self.lower_options = dataclasses.replace(options, dump_dir=dump_dir) if dump_dir else options
        check_same_config(frame.model, options)
        self.setup = rank_setup(frame.model, options, mesh.spec)
        self.programs: dict[tuple, Lowered] = {}
        self._full: dict[int, torch.Tensor] = {}   # id -> the model's own parameter
        self._names: dict[int, list[str]] = {}     # id -> its names (tied parameters have several)
        for name, p in frame.model.named_parameters(remove_duplicate=False):
            self._full.setdefault(id(p), p)
            self._names.setdefault(id(p), []).append(name)
        self._specs = self._shard_specs()
        self._reduced = list(self._specs)  # ids of the parameters that go through _TakeShards

    def _shard_specs(self) -> dict[int, _ShardSpec]:
        """The specs of the parameters that are split over tp or whose gradients are partial over
        cp (the others are used as they are: their gradients are already whole on every rank)."""
        spec = self.mesh.spec
        specs: dict[int, _ShardSpec] = {}
        for pid, group in self._names.items():
            layout = self.setup.plan.layout_of(group[0])
            if layout is not None:
                owned = layout.owned_index(spec.tp_rank)
                index = layout.global_index()
                specs[pid] = _ShardSpec(layout, tuple(owned), tuple(index[i] for i in owned))
            elif spec.cp > 1:  # replicated, but each cp rank's gradient covers its piece only
                specs[pid] = _ShardSpec(None)
        return specs

    def program(self, values: list[Any]) -> tuple[Lowered, list[Any]]:
        """This rank's program for these (whole) inputs and the values it takes (pieces under cp)."""
        length = None
        if self.options.cp > 1:
            from mambac.lowering import cp_pieces
            spec = self.mesh.spec
            whole = values
            values, length = cp_pieces(values, spec.cp_rank, spec.cp)
            values = [_SequencePiece.apply(w, spec.cp_rank, spec.cp, self.mesh.cp_group)
                      if isinstance(w, torch.Tensor) and w.dim() >= 2 and w.requires_grad and torch.is_grad_enabled()
                      else v for w, v in zip(whole, values)]
        key = signature_of(values) + ((length,) if length is not None else ())
        if key not in self.programs:
            self.programs[key] = lower(self.frame.model, values, self.lower_options, self.mesh.rank, self.setup,
                                       length)
        return self.programs[key], values

    def __call__(self, *args: Any) -> tuple:
        f = self.frame
        values = [v if slot is None else args[slot] for v, slot in zip(f.values, f.value_slots)]
        program, values = self.program(values)
        # dynamo passes the parameters as graph inputs; one it did not lift is read from the model
        full = {pid: args[f.param_slots[pid]] if pid in f.param_slots else p for pid, p in self._full.items()}
        taken = dict(full)
        if self._reduced:
            specs = tuple(self._specs[pid] for pid in self._reduced)
            shards = _TakeShards.apply(specs, self.mesh.spec.tp_rank, *(full[pid] for pid in self._reduced))
            taken.update(zip(self._reduced, shards))
        params = {name: taken[pid] for pid, group in self._names.items() for name in group}
        local = dict(program.gm.named_parameters(remove_duplicate=False))
        params = {k: v for k, v in params.items() if k in local}
        from mambac.ops import use_kernels
        with use_kernels(self.options.kernels):
            out = torch.func.functional_call(program.gm, params, tuple(values))
        leaves = pytree.tree_leaves(out)
        if len(leaves) != f.n_outputs:
            raise MambacRuntimeError(f"{type(f.model).__name__}.forward gave {len(leaves)} tensor(s) under mambac's "
                                     f"program but {f.n_outputs} in dynamo's graph; on several ranks the backend "
                                     "needs a forward that returns its tensors directly.")
        return tuple(leaves)
