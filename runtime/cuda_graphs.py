"""CUDA graphs for a compiled module's static shapes (``mambac.compile(..., cuda_graphs=True)``).

A call's *signature* is what a captured graph depends on: the lowered program, each input's shape,
dtype, device and ``requires_grad`` (the other inputs' values), grad mode, inference mode and the
CUDA autocast state.  The first call of a signature runs the program eagerly a few times on a side
stream (Triton compiles, autotuning and lazy initialisation happen there, never inside a capture),
then captures the forward, and when it trains the backward (``torch.autograd.grad`` of the
outputs), as two CUDA graphs sharing one private memory pool, and replays the forward for the call
itself.  Later calls with that signature copy their inputs into the graph's static input buffers
and replay: one ``torch.autograd.Function`` whose backward replays the backward graph.

Parameters are not copied: the graphs read every parameter (and every other leaf tensor the
outputs depend on, found by walking the autograd graph of a warm-up call) in place, so an optimizer
step between calls is seen by the next replay, and gradients land on the same parameters as
without graphs (``.grad`` accumulates as usual).  Warm-up and capture run the program on aliases of
the trainable parameters (``detach()``: same storage, fresh autograd leaves), so they never touch
the parameters' own gradient accumulators, which an earlier step's graph or DDP may hold on the
default stream (a capture may not depend on that stream).  Replacing a parameter's storage
(``.to()``, ``.data =``) or changing its ``requires_grad`` makes the next call capture that
signature again.

What is not captured, and what happens instead:

* a call while an earlier replay of the same signature still awaits its backward (two forwards of
  one shape summed into one loss, or an evaluation under grad mode whose outputs are still alive):
  the graph's saved activations belong to the earlier call, so this call runs eagerly;
* a new signature once ``MAX_SIGNATURES`` are captured (shapes that vary per call): runs eagerly,
  with a warning;
* a program that synchronises with the host (``.item()``, ``.cpu()``, data-dependent shapes)
  cannot be captured: the last warm-up call runs with host synchronisations made errors
  (``torch.cuda.set_sync_debug_mode``), so ``MambacRuntimeError`` names the inputs and the cause
  before any capture starts.

Outputs are copies of the graph's static outputs, so they stay valid across later calls.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from mambac.errors import MambacInputError, MambacOptionsError, MambacRuntimeError

log = logging.getLogger("mambac.runtime")

WARMUP_CALLS = 3     # eager forward+backward calls on a side stream before a capture
MAX_SIGNATURES = 8   # captured signatures per compiled module; each keeps its own activation memory


def check_supported(model: torch.nn.Module, options) -> None:
    """Before anything changes: ``cuda_graphs=True`` needs CUDA parameters and, on several ranks,
    an NCCL process group (gloo collectives on CPU tensors cannot be captured)."""
    if not options.cuda_graphs:
        return
    import torch.distributed as dist
    drop = "Drop cuda_graphs=True to run without CUDA graphs."
    if options.world_size > 1 and dist.is_available() and dist.is_initialized() and dist.get_backend() != "nccl":
        raise MambacOptionsError(
            f"cuda_graphs=True needs CUDA tensors and NCCL collectives, but the process group uses "
            f"'{dist.get_backend()}'. Initialise it with backend='nccl' on CUDA devices (one GPU per rank). {drop}")
    if not torch.cuda.is_available():
        raise MambacOptionsError(f"cuda_graphs=True needs CUDA tensors (and NCCL on several ranks), but this process "
                                 f"sees no CUDA device. {drop}")
    on_cpu = sorted({str(t.device) for t in list(model.parameters()) + list(model.buffers()) if not t.is_cuda})
    if on_cpu:
        raise MambacOptionsError(f"cuda_graphs=True needs CUDA tensors, but the model has parameters or buffers on "
                                 f"{', '.join(on_cpu)}. Move the model to the GPU before compiling (model.cuda()), "
                                 f"or drop cuda_graphs=True.")


@dataclass
class CudaGraphStats:
    """What the CUDA graphs of one compiled module did: signatures captured, calls served by a
    replay, and calls that ran eagerly (see the module docstring for when)."""

    captured: int = 0
    replays: int = 0
    eager: int = 0


def _autocast_state() -> tuple:
    return torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")


def _describe(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, str(value.device), value.requires_grad)
    try:
        hash(value)
    except TypeError:
        raise MambacInputError(f"cuda_graphs=True: an input of type {type(value).__name__} is neither a tensor nor "
                               "a hashable constant, so calls cannot be matched to a captured graph. Pass tensors "
                               "(or None, numbers, strings), or compile without cuda_graphs.") from None
    return ("value", type(value).__name__, value)


def _leaves_of(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that ``outputs`` depend on (parameters, mostly), in the order
    met, excluding ``inputs``: the tensors the graphs read in place and give gradients to."""
    skip = {id(t) for t in inputs}
    found: dict[int, torch.Tensor] = {}
    for o in outputs:
        if o.grad_fn is None and o.requires_grad and id(o) not in skip:
            found.setdefault(id(o), o)
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: dict[int, Any] = {}  # holds the node objects, so no id is reused while walking
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        leaf = getattr(fn, "variable", None)  # AccumulateGrad: the leaf it feeds
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in skip:
                found.setdefault(id(leaf), leaf)
            continue
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return list(found.values())


@contextlib.contextmanager
def _aliased(module: torch.nn.Module, alias: dict[int, torch.Tensor]) -> Iterator[None]:
    """Run ``module`` with each parameter whose id is in ``alias`` replaced by its alias (every
    module of the tree that holds it, so tied weights stay tied); restored on exit."""
    swapped = [(m, name, p) for m in module.modules() for name, p in m._parameters.items()
               if p is not None and id(p) in alias]
    for m, name, p in swapped:
        m._parameters[name] = alias[id(p)]
    try:
        yield
    finally:
        for m, name, p in swapped:
            m._parameters[name] = p


@contextlib.contextmanager
def _host_syncs_raise(values: Sequence[Any]) -> Iterator[None]:
    """Make any host synchronisation (``.item()``, ``.cpu()``, blocking copies) an error while the
    block runs: the last warm-up call finds what a capture could not hold, with CUDA left intact."""
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch notes that the mode is a prototype; the check is best effort
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:  # the earlier warm-up calls ran the same program without the check
        raise MambacRuntimeError(
            f"cuda_graphs=True: the program synchronises with the host during a call (inputs "
            f"{[_describe(v) for v in values]}: {str(exc).strip()[:300]}), so it cannot be captured as a CUDA "
            "graph (.item(), .cpu(), data-dependent shapes, printing tensors). Remove the synchronisation, or "
            "compile without cuda_graphs=True.") from exc
    finally:
        torch.cuda.set_sync_debug_mode(before)


class _Captured:
    """One signature's graphs, static buffers, and the tensors they read in place."""

    def __init__(self) -> None:
        self.fwd = torch.cuda.CUDAGraph()
        self.bwd: torch.cuda.CUDAGraph | None = None
        self.inputs: list[Any] = []                  # static call values (tensors are our buffers)
        self.tensor_pos: list[int] = []              # positions of the tensor inputs
        self.leaves: list[torch.Tensor] = []         # parameters and other leaves, read in place
        self.watch: list[tuple[torch.Tensor, int, bool]] = []  # (tensor, data_ptr, requires_grad)
        self.out_flat: list[Any] = []                # static outputs, flattened
        self.out_spec = None
        self.out_tensor_pos: list[int] = []
        self.out_diff: list[bool] = []               # per tensor output: differentiable
        self.grad_out_bufs: list[torch.Tensor | None] = []  # per tensor output
        self.grads: tuple[torch.Tensor | None, ...] = ()    # per Function input (tensor inputs, then leaves)
        self.generation = 0                          # forward replays so far
        self.last_ctx: Callable[[], Any] | None = None      # weakref to the newest replay's autograd node

    def still_valid(self) -> bool:
        return all(t.data_ptr() == ptr and t.requires_grad == rg for t, ptr, rg in self.watch)

    def awaiting_backward(self) -> bool:
        ctx = self.last_ctx() if self.last_ctx is not None else None
        return ctx is not None and not getattr(ctx, "done", False)

    def copy_inputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy this call's tensor inputs (in ``tensor_pos`` order) into the static buffers."""
        for i, t in zip(self.tensor_pos, tensors):
            self.inputs[i].copy_(t)

    def outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        flat = list(self.out_flat)
        for pos, t in zip(self.out_tensor_pos, tensors):
            flat[pos] = t
        return tree_unflatten(flat, self.out_spec)


class _Replay(torch.autograd.Function):
    """Replays a captured forward; its backward replays the captured backward."""

    @staticmethod
    def forward(ctx, cap: _Captured, *tensors: torch.Tensor):
        cap.copy_inputs(tensors[:len(cap.tensor_pos)])
        cap.fwd.replay()
        cap.generation += 1
        ctx.cap, ctx.generation, ctx.done = cap, cap.generation, False
        cap.last_ctx = weakref.ref(ctx)
        outs = tuple(cap.out_flat[p].clone() for p in cap.out_tensor_pos)
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, cap.out_diff) if not d])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads: torch.Tensor):
        cap: _Captured = ctx.cap
        if ctx.generation != cap.generation:
            raise MambacRuntimeError(
                "cuda_graphs: this backward belongs to an earlier call whose saved activations a later call with "
                "the same input shapes has overwritten (replays share one graph). Call backward before the next "
                "forward of the same shapes, or compile without cuda_graphs.")
        for buf, g in zip(cap.grad_out_bufs, grads):
            if buf is not None:
                buf.copy_(g)
        cap.bwd.replay()
        ctx.done = True
        # The static gradient buffers themselves: autograd copies or adds them into .grad (it never
        # keeps a tensor another reference holds), so the next replay cannot change a stored .grad.
        return (None,) + cap.grads


class CudaGraphs:
    """The captured graphs of one compiled module, by signature."""

    def __init__(self) -> None:
        self.stats = CudaGraphStats()
        self._captured: dict[Hashable, _Captured] = {}
        self._warned: set[str] = set()

    def signature(self, program: Any, values: Sequence[Any]) -> Hashable:
        return (id(program), torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _autocast_state(),
                tuple(_describe(v) for v in values))

    def run(self, program: Any, values: list[Any], run: Callable[[list[Any]], Any]) -> Any:
        """The outputs of ``run(values)`` (``program``'s forward), from a replay when possible."""
        for i, v in enumerate(values):
            if isinstance(v, torch.Tensor) and not v.is_cuda:
                raise MambacInputError(f"cuda_graphs=True: input {i} is on {v.device}; pass CUDA tensors (the "
                                       "captured graphs read CUDA buffers).")
        key = self.signature(program, values)
        cap = self._captured.get(key)
        if cap is not None and not cap.still_valid():
            log.info("cuda_graphs: parameters were replaced or (un)frozen since the capture; capturing again")
            del self._captured[key]
            cap = None
        if cap is None:
            if len(self._captured) >= MAX_SIGNATURES:
                self._warn_once("limit", f"cuda_graphs: {MAX_SIGNATURES} input signatures are captured already; "
                                "calls with new shapes run without graphs (each captured signature keeps its own "
                                "activation memory). Pad inputs to a few fixed shapes.")
                self.stats.eager += 1
                return run(values)
            cap = self._capture(program, values, run)
            self._captured[key] = cap
            self.stats.captured += 1
        elif cap.awaiting_backward():
            self._warn_once("pending", "cuda_graphs: a call came while an earlier call with the same input shapes "
                            "still awaits its backward, so it ran without graphs (the graph's saved activations "
                            "belong to the earlier call). Call backward (or drop the outputs) first, and evaluate "
                            "under torch.no_grad().")
            self.stats.eager += 1
            return run(values)
        self.stats.replays += 1
        if cap.bwd is None:
            cap.copy_inputs([values[i] for i in cap.tensor_pos])
            cap.fwd.replay()
            cap.generation += 1
            return cap.outputs([cap.out_flat[p].clone() for p in cap.out_tensor_pos])
        tensors = [values[i] for i in cap.tensor_pos] + cap.leaves
        return cap.outputs(_Replay.apply(cap, *tensors))

    def _warn_once(self, what: str, text: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(text, stacklevel=4)

    def _capture(self, program: Any, values: list[Any], run: Callable[[list[Any]], Any]) -> _Captured:
        cap = _Captured()
        cap.tensor_pos = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        cap.inputs = list(values)
        for i in cap.tensor_pos:
            cap.inputs[i] = values[i].detach().clone().requires_grad_(values[i].requires_grad)
        static_in = [cap.inputs[i] for i in cap.tensor_pos]
        gm = getattr(program, "gm", program)
        params = list(dict.fromkeys(gm.parameters()))
        trainable = [p for p in params if p.requires_grad]
        train = torch.is_grad_enabled()
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)  # a cached cast would outlive the capture and miss updates
        try:
            cap.leaves = self._warm_up(cap, gm, run, static_in, trainable, train)
            alias = {id(p): p.detach().requires_grad_() for p in trainable}
            surface = [t for t in static_in if t.requires_grad] + [alias.get(id(t), t) for t in cap.leaves]
            pool = torch.cuda.graph_pool_handle()
            try:
                with torch.cuda.graph(cap.fwd, pool=pool), _aliased(gm, alias):
                    outputs = run(cap.inputs)
                cap.out_flat, cap.out_spec = tree_flatten(outputs)
                cap.out_tensor_pos = [i for i, o in enumerate(cap.out_flat) if isinstance(o, torch.Tensor)]
                outs = [cap.out_flat[i] for i in cap.out_tensor_pos]
                cap.out_diff = [o.requires_grad for o in outs]
                diff = [o for o in outs if o.requires_grad]
                if train and diff and surface:
                    cap.grad_out_bufs = [torch.empty_like(o) if o.requires_grad else None for o in outs]
                    cap.bwd = torch.cuda.CUDAGraph()
                    with torch.autocast("cuda", enabled=False), torch.cuda.graph(cap.bwd, pool=pool), \
                            _aliased(gm, alias):  # recomputed regions read the aliases too
                        got = torch.autograd.grad(diff, surface, [b for b in cap.grad_out_bufs if b is not None],
                                                  allow_unused=True)
                    by_id = {id(t): g for t, g in zip(surface, got)}
                    cap.grads = tuple(by_id.get(id(t)) for t in static_in) + tuple(
                        by_id.get(id(alias.get(id(t), t))) for t in cap.leaves)
            except Exception as exc:
                raise MambacRuntimeError(
                    f"cuda_graphs=True: the program could not be captured as a CUDA graph for inputs "
                    f"{[_describe(v) for v in values]}: {type(exc).__name__}: {str(exc).strip()[:500]}. Compile "
                    "without cuda_graphs=True (after a failed capture this process's CUDA state may be unusable; "
                    "restart it).") from exc
        finally:
            torch.set_autocast_cache_enabled(cache)
        cap.out_flat = [o.detach() if isinstance(o, torch.Tensor) else o for o in cap.out_flat]
        watched = list(dict.fromkeys(params + cap.leaves))
        cap.watch = [(t, t.data_ptr(), t.requires_grad) for t in watched]
        log.info("cuda_graphs: captured %s (forward%s, %d tensors read in place)", [_describe(v) for v in values],
                 " and backward" if cap.bwd is not None else "", len(cap.leaves))
        return cap

    @staticmethod
    def _warm_up(cap: _Captured, gm: torch.nn.Module, run: Callable[[list[Any]], Any],
                 static_in: list[torch.Tensor], trainable: list[torch.Tensor], train: bool) -> list[torch.Tensor]:
        """Eager calls on a side stream (compiles, autotuning, lazy init), on aliases of the
        trainable parameters; returns the leaves the outputs depend on (the parameters themselves,
        not their aliases)."""
        leaves: list[torch.Tensor] = []
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            alias = {id(p): p.detach().requires_grad_() for p in trainable}
            original = {id(alias[id(p)]): p for p in trainable}
            for k in range(WARMUP_CALLS):
                last = k == WARMUP_CALLS - 1  # compiles and autotuning are done by now
                with _aliased(gm, alias), _host_syncs_raise(cap.inputs) if last else contextlib.nullcontext():
                    outs = [o for o in tree_flatten(run(cap.inputs))[0] if isinstance(o, torch.Tensor)]
                    diff = [o for o in outs if o.requires_grad]
                    if k == 0:
                        leaves = [original.get(id(t), t) for t in _leaves_of(diff, static_in)]
                    surface = [t for t in static_in if t.requires_grad] + [alias.get(id(t), t) for t in leaves]
                    if train and diff and surface:
                        with torch.autocast("cuda", enabled=False):
                            torch.autograd.grad(diff, surface, [torch.ones_like(o) for o in diff],
                                                allow_unused=True)
                    del outs, diff
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return leaves
