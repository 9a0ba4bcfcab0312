"""Shared machinery for mambac's custom ops.

Every op module in ``mambac/ops`` defines a plain-PyTorch *reference* function (differentiable,
written with ordinary torch ops, exact in float64) and registers a ``torch.library`` custom op whose
eager implementation calls that reference.  The autograd rule registered here recomputes the
reference under ``torch.enable_grad`` and takes its vector-Jacobian product: it is exact, needs no
hand-written backward, and stays correct whatever options the op was called with.  Faster backward
kernels (Triton, see ``mambac.codegen``) replace the per-device implementation, never the semantics.

Invariant: an op's reference is the single source of truth; fake (meta) functions only describe
shapes and dtypes and must agree with the reference on every output.

Device kernels (``register_device_kernels``): generated kernels register a forward, a backward
and a ``supports`` predicate per op and device.  Every op's eager implementation for CPU and CUDA
tensors goes through a small dispatcher that runs the registered forward when the kernel mode
allows it (``use_kernels`` / ``kernel_mode``; 'auto' = kernels on CUDA, 'triton' = also CPU
tensors under ``TRITON_INTERPRET=1``, 'reference' = never) and ``supports(*args)`` is true, and
the op's own implementation otherwise; the autograd rule does the same for the backward, with the
mode that was in force when the forward ran.  Kernels are registered on first use: the dispatcher
imports ``mambac.codegen.wiring`` (and every ``mambac.codegen.*_wiring`` module) the first time a
call could use them, so CPU-only processes in 'auto' mode never load them.
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from mambac.errors import MambacInputError

log = logging.getLogger("mambac.ops")


@dataclass(frozen=True)
class OpInfo:
    """What the rest of mambac needs to know about one op.

    ``op`` is the custom-op overload packet (``torch.ops.mambac.<name>``), ``reference`` the plain
    PyTorch function with the same positional signature, ``arg_names`` the schema's argument names
    in order (passes use them to read and rewrite arguments by name), ``n_outputs`` how many tensors
    the op returns.
    """

    name: str
    op: Any
    reference: Callable[..., Any]
    arg_names: tuple[str, ...]
    n_outputs: int
    doc: str = ""
    extra: dict = field(default_factory=dict)


_REGISTRY: dict[str, OpInfo] = {}


def register_info(info: OpInfo) -> OpInfo:
    _REGISTRY[info.name] = info
    return info


def op_info(name: str) -> OpInfo:
    return _REGISTRY[name]


def all_op_infos() -> dict[str, OpInfo]:
    return dict(_REGISTRY)


def info_for_target(target: Any) -> OpInfo | None:
    """The OpInfo whose custom op is ``target`` (an OpOverloadPacket or OpOverload), else None."""
    packet = getattr(target, "overloadpacket", target)
    for info in _REGISTRY.values():
        if info.op is packet:
            return info
    return None


def state_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Recurrent state is at least fp32: float64 inputs (the referee) keep float64."""
    for t in tensors:
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Dtype that a reference computes in: fp32 for half types, the input dtype otherwise."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def register_recompute_autograd(op: Any, reference: Callable[..., Any], n_outputs: int) -> None:
    """Give ``op`` an autograd rule that differentiates ``reference`` by recomputation.

    Tensor inputs are saved (not the outputs); non-tensor inputs ride on ``ctx``.  Gradients of
    outputs that the caller did not use arrive as ``None`` and are skipped.  When device kernels
    with a backward are registered for the op and may run (see the module docstring), they give
    the gradients instead.  Also installs the forward dispatcher (``_install_dispatch``) and the
    op's backward as a custom op of its own, ``mambac::<name>_backward`` (``_register_backward_op``),
    which a tracer (AOTAutograd) records as one opaque node instead of unrolling the recomputation.
    """
    name = _op_name(op)
    _install_dispatch(op, name)
    backward_op, tensor_args = _register_backward_op(op, name, reference)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        tensor_pos = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.tensor_pos = tensor_pos
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.kernel_mode = kernel_mode()
        ctx.save_for_backward(*[inputs[i] for i in tensor_pos])

    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        saved = ctx.saved_tensors
        args = list(ctx.others)
        for pos, t in zip(ctx.tensor_pos, saved):
            args[pos] = t
        if not any(ctx.needs_input_grad):
            return (None,) * len(args)
        if not _tracing():
            return gradients_by_recompute(name, reference, args, grads, tuple(ctx.needs_input_grad), ctx.kernel_mode)
        needs = [bool(ctx.needs_input_grad[i]) for i in tensor_args]
        got = backward_op(*args, list(grads), needs, ctx.kernel_mode)
        result = [None] * len(args)
        for i, g, need in zip(tensor_args, got, needs):
            result[i] = g if need and args[i] is not None else None
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)


def gradients_by_recompute(name: str, reference: Callable[..., Any], args: list, grads: Sequence[Any],
                           needs_input_grad: tuple, mode: str) -> tuple:
    """The input gradients of op ``name`` at ``args`` for output gradients ``grads``: the device
    kernels' backward where they may run (``mode``), else the vector-Jacobian product of
    ``reference`` recomputed under autograd.  One entry per argument, None where not needed."""
    args = list(args)
    kset = _usable(name, args, mode, need_backward=True)
    if kset is not None:
        return _kernel_backward(kset, args, tuple(grads), needs_input_grad)
    wants = []
    for pos, t in enumerate(args):
        if not isinstance(t, torch.Tensor):
            continue
        need = needs_input_grad[pos] and t.is_floating_point()
        leaf = t.detach().requires_grad_(need)
        args[pos] = leaf
        if need:
            wants.append((pos, leaf))
    result = [None] * len(args)
    if not wants:
        return tuple(result)
    with torch.enable_grad():
        outs = reference(*args)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
    if not pairs:
        return tuple(result)
    got = torch.autograd.grad(
        [o for o, _ in pairs], [leaf for _, leaf in wants], [g for _, g in pairs], allow_unused=True
    )
    for (pos, leaf), g in zip(wants, got):
        result[pos] = torch.zeros_like(leaf) if g is None else g
    return tuple(result)


@contextlib.contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Autograd back on inside a custom op's implementation (the dispatcher runs it below the
    autograd keys), so that the recompute can record and differentiate the reference."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude):
        yield


def _tracing() -> bool:
    """Whether a tracer (make_fx, hence AOTAutograd) is recording the ops being run."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    return get_proxy_mode() is not None


def _register_backward_op(op: Any, name: str, reference: Callable[..., Any]) -> tuple[Any, list[int]]:
    """``mambac::<name>_backward(<op's arguments>, Tensor?[] grads, bool[] needs, str mode) -> Tensor[]``:
    the gradient of every tensor argument of ``op`` (``needs`` says which are wanted; an unwanted
    or absent one comes back as an empty tensor).  Its eager implementation is
    ``gradients_by_recompute``; its fake one gives each wanted gradient its input's shape, dtype and
    strides.  Returns the op and the positions of ``op``'s tensor arguments."""
    schema = op._opoverload._schema
    text = str(schema)
    arg_text = text[text.index("(") + 1: text.rindex(") ->")]
    tensor_args = [i for i, a in enumerate(schema.arguments) if str(a.type) in ("Tensor", "Optional[Tensor]")]
    n_args = len(schema.arguments)

    def _empty(args: Sequence[Any]) -> torch.Tensor:
        like = next(a for a in args if isinstance(a, torch.Tensor))
        return like.new_empty(0)

    def impl(*call: Any) -> list[torch.Tensor]:
        args, grads, needs, mode = list(call[:n_args]), call[n_args], call[n_args + 1], call[n_args + 2]
        needs_input_grad = [False] * n_args
        for i, need in zip(tensor_args, needs):
            needs_input_grad[i] = bool(need) and args[i] is not None
        with _autograd_inside_op():
            got = gradients_by_recompute(name, reference, args, grads, tuple(needs_input_grad), mode)
        taken = {t.untyped_storage().data_ptr() for t in list(args) + list(grads)
                 if isinstance(t, torch.Tensor) and t.numel()}
        out = []
        for i in tensor_args:
            g = got[i] if got[i] is not None else _empty(args)
            if g.numel() and g.untyped_storage().data_ptr() in taken:  # a custom op's outputs own their memory
                g = g.clone()
            if g.numel():
                taken.add(g.untyped_storage().data_ptr())
            out.append(g)
        return out

    def fake(*call: Any) -> list[torch.Tensor]:
        args, needs = call[:n_args], call[n_args + 1]
        return [torch.empty_like(args[i]) if need and args[i] is not None else _empty(args)
                for i, need in zip(tensor_args, needs)]

    backward_op = torch.library.custom_op(f"mambac::{name}_backward", mutates_args=(),
                                          schema=f"({arg_text}, Tensor?[] grads, bool[] needs, str mode) -> Tensor[]")(impl)
    backward_op.register_fake(fake)
    return backward_op, tensor_args


# ---- device kernels -----------------------------------------------------------------------------

KERNEL_MODES = ("auto", "triton", "reference")
KERNEL_DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class DeviceKernels:
    """The kernels one op has on one device (see ``register_device_kernels``)."""

    name: str
    device: str
    forward: Callable[..., Any] | None
    backward: Callable[[list, tuple, tuple], tuple] | None
    supports: Callable[..., bool] | None


_DEVICE_KERNELS: dict[tuple[str, str], DeviceKernels] = {}
_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("mambac_kernel_mode", default=None)
_PROVIDERS_LOADED = False


def register_device_kernels(name: str, device: str = "cuda", *, forward: Callable[..., Any] | None = None,
                            backward: Callable[[list, tuple, tuple], tuple] | None = None,
                            supports: Callable[..., bool] | None = None) -> None:
    """Register kernels for op ``name`` on ``device`` (re-registering replaces them).

    ``forward(*args)`` takes the op's schema arguments and returns what the reference returns;
    ``backward(args, grads, needs_input_grad)`` returns one gradient (or None) per argument;
    ``supports(*args)`` says whether the kernels take these inputs (default: no float64 tensor).
    Kernels registered for "cuda" also serve CPU tensors in mode 'triton' under TRITON_INTERPRET=1.
    """
    if name not in _REGISTRY:
        raise MambacInputError(f"register_device_kernels: no op named {name!r}; known ops: "
                               f"{', '.join(sorted(_REGISTRY))}.")
    if device not in KERNEL_DEVICES:
        raise MambacInputError(f"register_device_kernels: device must be one of {KERNEL_DEVICES}, got {device!r}.")
    if forward is None and backward is None:
        raise MambacInputError(f"register_device_kernels({name!r}): give a forward, a backward or both.")
    _DEVICE_KERNELS[(name, device)] = DeviceKernels(name, device, forward, backward, supports)


def unregister_device_kernels(name: str, device: str = "cuda") -> None:
    """Forget the kernels of ``name`` on ``device`` (the reference runs again)."""
    _DEVICE_KERNELS.pop((name, device), None)


def registered_device_kernels() -> dict[tuple[str, str], DeviceKernels]:
    """Every registration, keyed by (op name, device); loads the kernel providers first."""
    _load_providers()
    return dict(_DEVICE_KERNELS)


def _check_mode(mode: str) -> str:
    if mode not in KERNEL_MODES:
        raise MambacInputError(f"kernel mode must be one of {KERNEL_MODES}, got {mode!r} "
                               "(MAMBAC_KERNELS or compile(kernels=...)).")
    return mode


def kernel_mode() -> str:
    """The mode in force: the innermost ``use_kernels``, where 'auto' defers to MAMBAC_KERNELS."""
    from mambac.knobs import knobs
    mode = _MODE.get()
    if mode is None or mode == "auto":
        return _check_mode(knobs().kernels)
    return mode


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Run the block with generated kernels in ``mode``: 'auto' | 'triton' | 'reference'."""
    token = _MODE.set(_check_mode(mode))
    try:
        yield
    finally:
        _MODE.reset(token)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on ``device_type`` now, or None where autocast is off."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _device_allowed(device_type: str, mode: str) -> bool:
    if mode == "reference":
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and mode == "triton" and interpreting()


def kernels_enabled(device: str | torch.device | None = None) -> bool:
    """Whether generated kernels may run now for tensors on ``device`` (default: CUDA if present,
    else the CPU); inputs a kernel does not support still take the reference."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _device_allowed(torch.device(device).type, kernel_mode())


def _load_providers() -> None:
    """Import the modules that register generated kernels (once per process)."""
    global _PROVIDERS_LOADED
    if _PROVIDERS_LOADED:
        return
    _PROVIDERS_LOADED = True
    try:
        pkg = importlib.import_module("mambac.codegen")
        names = ["mambac.codegen.wiring"] + sorted(
            f"mambac.codegen.{m.name}" for m in pkgutil.iter_modules(pkg.__path__)
            if m.name.endswith("_wiring"))
    except Exception as exc:  # no codegen package: the references run
        log.warning("generated kernels unavailable (%r); using reference ops", exc)
        return
    for mod in names:
        try:
            importlib.import_module(mod)
        except Exception as exc:
            log.warning("kernel provider %s failed to load (%r); its ops use the reference", mod, exc)


def _first_device(args: Sequence[Any]) -> str | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return None


def _usable(name: str, args: Sequence[Any], mode: str, need_backward: bool = False) -> DeviceKernels | None:
    """The registration whose kernels should run for these arguments, or None for the reference."""
    dev = _first_device(args)
    if dev is None or not _device_allowed(dev, mode):
        return None
    _load_providers()
    kset = _DEVICE_KERNELS.get((name, dev)) or (_DEVICE_KERNELS.get((name, "cuda")) if dev == "cpu" else None)
    if kset is None or (kset.backward if need_backward else kset.forward) is None:
        return None
    if kset.supports is not None:
        ok = kset.supports(*args)
    else:
        ok = not any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)
    return kset if ok else None


def _kernel_backward(kset: DeviceKernels, args: list, grads: tuple, needs: tuple) -> tuple:
    detached = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        got = tuple(kset.backward(detached, grads, needs))
    if len(got) != len(args):
        raise RuntimeError(f"backward kernel of {kset.name} returned {len(got)} gradients for "
                           f"{len(args)} arguments")
    return tuple(g if need else None for g, need in zip(got, needs))


def _op_name(op: Any) -> str:
    return str(getattr(op, "_name", None) or getattr(op, "__name__", "")).split("::")[-1]


def _install_dispatch(op: Any, name: str) -> None:
    """Route ``op``'s CPU and CUDA implementation through the registered device kernels."""
    impl = getattr(op, "_init_fn", None)
    if impl is None or not hasattr(op, "register_kernel"):
        return

    def dispatch(*args: Any) -> Any:
        kset = _usable(name, args, kernel_mode())
        if kset is None:
            return impl(*args)
        return kset.forward(*args)

    op.register_kernel(KERNEL_DEVICES)(dispatch)


def check(cond: bool, op: str, message: str | Callable[[], str]) -> None:
    """Raise a MambacInputError naming the op when ``cond`` is false.  ``message`` may be a
    function that builds it: then it is formatted only on failure, which keeps a symbolic number
    (a float or int that ``torch.compile(dynamic=True)`` does not specialise) out of an f-string
    that dynamo cannot trace."""
    if not cond:
        raise MambacInputError(f"mambac.ops.{op}: {message() if callable(message) else message}")


def check_float(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise MambacInputError(
                f"mambac.ops.{op}: {name} must be a tensor or None, got {type(t).__name__} {t!r:.40}; "
                "check the order of the arguments (or pass them by keyword)."
            )
        if t is not None and not t.is_floating_point():
            raise MambacInputError(
                f"mambac.ops.{op}: {name} must be a floating-point tensor, got {t.dtype}; "
                f"cast it with {name}.float() (or .bfloat16())."
            )


def check_shape(op: str, name: str, t: torch.Tensor | None, shape: Sequence[int | None]) -> None:
    """Check ``t``'s shape against ``shape`` (None entries match anything)."""
    if t is None:
        return
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise MambacInputError(f"mambac.ops.{op}: {name} has shape {tuple(t.shape)}, expected {want}.")
