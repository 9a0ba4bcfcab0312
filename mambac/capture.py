"""Capture: an ``nn.Module`` → a ``torch.fx.GraphModule`` with fake-tensor shapes on every node.

``torch.fx.symbolic_trace`` does the tracing; mambac's tracer also records, for every node, the path
and type of the module that produced it (``node.meta[SOURCE]``), so errors and dumps can name
modules.  SSM ops stay single ``call_function`` nodes because they are custom ops.  Optional forward
arguments that are not given are specialised to their defaults (the compiled module keeps one graph
per set of given arguments).  Any tracing or shape failure becomes a ``MambacCaptureError`` that
names the module and the construct and says what to do.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from mambac.errors import MambacCaptureError
from mambac.ir import SOURCE, VAL, SourceInfo

FAKE_MODE_KEY = "mambac_fake_mode"


class _Tracer(torch.fx.Tracer):
    """fx tracer that remembers which module each node was created in."""

    def __init__(self) -> None:
        super().__init__()
        self.path_stack: list[tuple[str, str]] = [("", "")]
        self.failed_at: tuple[str, str] | None = None  # innermost module active when tracing failed

    def call_module(self, m: torch.nn.Module, forward, args, kwargs):
        path = self.path_of_module(m)
        self.path_stack.append((path, type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_at is None:
                self.failed_at = self.path_stack[-1]
            raise
        finally:
            self.path_stack.pop()

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        path, typ = self.path_stack[-1]
        if kind == "call_module":
            path, typ = str(target), type(self.root.get_submodule(str(target))).__name__
        node.meta[SOURCE] = SourceInfo(module_path=path, module_type=typ)
        return node


_HINTS = [
    ("symbolically traced variables cannot be used as inputs to control flow",
     "Python control flow (if/while/bool()) on a tensor value",
     "compute the condition from configuration instead of tensor values, or move it out of forward()"),
    ("Proxy object cannot be iterated",
     "iteration over a tensor (for x in tensor / tuple unpacking of a tensor)",
     "use torch.split/torch.unbind or index explicitly"),
    ("object of type 'Proxy' has no len()",
     "len() of a tensor",
     "use tensor.shape[0] instead of len(tensor)"),
]


def _explain(exc: Exception, where: tuple[str, str]) -> MambacCaptureError:
    text = str(exc)
    path, typ = where
    loc = f"module '{path or '<root>'}' ({typ or 'model'})"
    for needle, construct, todo in _HINTS:
        if needle in text:
            return MambacCaptureError(f"cannot capture {loc}: it uses {construct}, which mambac's graph capture "
                                      f"cannot follow. To fix: {todo}. (fx said: {text.splitlines()[0]})")
    return MambacCaptureError(f"cannot capture {loc}: {type(exc).__name__}: {text.splitlines()[0] if text else ''}. "
                              "If this module is not a Mamba model mambac knows, register a converter "
                              "(mambac.convert.register_converter, see docs/models.md) or make its forward traceable by torch.fx.")


def _concrete_args(model: torch.nn.Module, n_given: int, kwargs: dict) -> dict:
    """Forward parameters beyond the given ones are specialised to their defaults."""
    sig = inspect.signature(model.forward)
    out = {}
    for i, (name, p) in enumerate(sig.parameters.items()):
        if i < n_given or name in kwargs:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise MambacCaptureError(f"{type(model).__name__}.forward needs argument '{name}', but only "
                                     f"{n_given} example input(s) were given.")
        out[name] = p.default
    return out


def trace(model: torch.nn.Module, n_inputs: int, kwargs: dict | None = None) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` with ``n_inputs`` positional tensor inputs (no shapes yet)."""
    return trace_with(model, _concrete_args(model, n_inputs, kwargs or {}))


CHECKPOINT_CALLS = "mambac_checkpoint_calls"   # gm.meta: per torch.utils.checkpoint call traced through,
                                               # the checkpointed submodule's path (None: another callable)


class _CheckpointStandIn:
    """``CheckpointFunction`` while tracing: ``apply(fn, preserve_rng, *args)`` calls ``fn``."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def apply(self, function, preserve_rng_state, *args):
        self.seen.append(function)
        return function(*args)


@contextlib.contextmanager
def _checkpoints_traced_through(seen: list) -> Iterator[None]:
    """While tracing, ``torch.utils.checkpoint.checkpoint`` (both of its forms) runs the checkpointed
    function as it is, so fx records its ops, and each call is counted in ``seen``: the recompute
    it asks for is mambac's ``remat`` option's to give (``lowering.lower`` says so)."""
    import torch.utils.checkpoint as ckpt
    names = ("_checkpoint_without_reentrant_generator", "CheckpointFunction")
    saved = {n: getattr(ckpt, n, None) for n in names}
    if any(v is None for v in saved.values()):   # another torch's internals: trace as before
        yield
        return

    def plain(function, *args, **kwargs):
        seen.append(function)
        yield

    ckpt._checkpoint_without_reentrant_generator = plain
    ckpt.CheckpointFunction = _CheckpointStandIn(seen)
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(ckpt, n, v)


def trace_with(model: torch.nn.Module, concrete: dict) -> torch.fx.GraphModule:
    """Symbolically trace ``model`` with the parameters in ``concrete`` fixed to those values."""
    if not isinstance(model, torch.nn.Module):
        raise MambacCaptureError(f"mambac captures torch.nn.Module instances, got {type(model).__name__}.")
    tracer = _Tracer()
    checkpoints: list = []
    try:
        with _checkpoints_traced_through(checkpoints):
            graph = tracer.trace(model, concrete_args=concrete or None)
    except MambacCaptureError:
        raise
    except Exception as exc:  # fx raises many types; all become one clear error
        raise _explain(exc, tracer.failed_at or ("", type(model).__name__)) from exc
    _drop_specialisation_asserts(graph)
    gm = torch.fx.GraphModule(tracer.root, graph, class_name=type(model).__name__ + "Graph")
    gm.meta[CHECKPOINT_CALLS] = [_module_path(tracer, fn) for fn in checkpoints]
    return gm


def _module_path(tracer: torch.fx.Tracer, function: Any) -> str | None:
    """The path of the checkpointed submodule (``backbone.layers.3``), None for another callable."""
    if isinstance(function, torch.nn.Module):
        try:
            return tracer.path_of_module(function)
        except NameError:
            return None
    return None


def _drop_specialisation_asserts(graph: torch.fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            graph.erase_node(node)


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)


def symbolic_dispatch(mode: FakeTensorMode | None) -> contextlib.AbstractContextManager:
    """Where ``mode`` has symbolic sizes (a shape environment, as under dynamo), the Python
    dispatcher on, as dynamo and AOTAutograd have it when they trace: some C++ composites
    otherwise ask a fake tensor for concrete sizes, and each such question pins a dynamic size to
    its value (torch 2.11's ``matmul`` behind ``F.linear`` pins the sequence length, and every new
    length then compiles again).  Elsewhere nothing changes."""
    from torch._dispatch.python import enable_python_dispatcher
    symbolic = mode is not None and getattr(mode, "shape_env", None) is not None
    return enable_python_dispatcher() if symbolic else contextlib.nullcontext()


def repropagate(gm: torch.fx.GraphModule, mode: FakeTensorMode, values: Sequence[Any]) -> None:
    """Fill ``node.meta['val']`` again from fake ``values`` of the placeholders (already in
    ``mode``), under ``symbolic_dispatch``."""
    with symbolic_dispatch(mode):
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*values)


def propagate_shapes(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], mode: FakeTensorMode | None = None) -> None:
    """Fill ``node.meta['val']`` on every node by running the graph on fake tensors; the fake mode
    is kept in ``gm.meta`` so passes can compute the shapes of nodes they create."""
    mode = mode or gm.meta.get(FAKE_MODE_KEY) or fake_mode()
    gm.meta[FAKE_MODE_KEY] = mode
    fakes = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    prop = FakeTensorProp(gm, mode)
    # Under autocast, casting a weight caches the cast copy; a fake copy left in that cache would be
    # handed to the real run that follows inside the same autocast region.
    cache_was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with symbolic_dispatch(mode):
            prop.propagate(*fakes)
    except MambacCaptureError:
        raise
    except Exception as exc:
        bad = next((n for n in gm.graph.nodes if n.op != "placeholder" and VAL not in n.meta), None)
        where = (bad.meta[SOURCE].module_path, bad.meta[SOURCE].module_type) if bad is not None and SOURCE in bad.meta else ("", "")
        raise MambacCaptureError(
            f"shape propagation failed at node '{bad.name if bad else '?'}' in module '{where[0] or '<root>'}' "
            f"({where[1] or 'model'}): {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}. "
            "Check that the example inputs have the shapes and dtypes the model expects.") from exc
    finally:
        torch.set_autocast_cache_enabled(cache_was)
    for node in gm.graph.nodes:  # values that are None (unused optional inputs) still get an entry
        node.meta.setdefault(VAL, None)


def capture(model: torch.nn.Module, example_inputs: Sequence[Any] = (), **kwargs: Any) -> torch.fx.GraphModule:
    """Capture ``model`` into a GraphModule whose SSM ops are single nodes and whose every node
    carries fake-tensor shapes from ``example_inputs`` (taken from ``model.example_inputs()`` when
    empty and the model provides it)."""
    if not example_inputs:
        maker = getattr(model, "example_inputs", None)
        if maker is None:
            raise MambacCaptureError(f"{type(model).__name__} has no example_inputs(); pass example inputs "
                                     "to capture, e.g. mambac.capture(model, (torch.randn(2, 16, d_model),)).")
        example_inputs = maker()
    gm = trace(model, len(example_inputs), kwargs)
    propagate_shapes(gm, example_inputs)
    return gm
