"""Fused, chunked ``cross_entropy(hidden @ weight.T, labels)``: the LM head and its loss without the
full (tokens, vocab) logits.

The forward walks the tokens in chunks: one chunk's logits are computed (in the ambient autocast
dtype, like ``nn.Linear``), reduced to a log-sum-exp and a target logit in fp32 (fp64 for fp64
inputs) and dropped.  Only ``hidden``, ``weight``, ``labels`` and the per-token log-sum-exp (N
floats) are saved.  The backward recomputes each chunk's logits under the autocast state recorded
in the forward and forms ``(softmax - onehot) * valid / count`` directly, so the logits and their
gradient exist one chunk at a time.  ``fuse_loss`` (docs/passes/fuse_loss.md) puts this function
into lowered graphs in place of ``lm_head`` → ``cross_entropy``.

When generated kernels are enabled for the device (``kernels_enabled``: CUDA in modes 'auto' and
'triton', CPU tensors in mode 'triton' under ``TRITON_INTERPRET=1``) and the logits are fp32, bf16
or fp16, the elementwise passes over each chunk are two generated Triton kernels
(``mambac.codegen.lce_kernels``): the forward's statistics in one read of the chunk, the backward's
gradient written over the chunk's logits in one read and one write.  The forward decides which
path runs and the backward follows it; float64 and kernel-less devices keep the PyTorch passes.

It is a ``torch.library`` op (``mambac::linear_cross_entropy``, with its backward
``mambac::linear_cross_entropy_backward``), so a tracer (AOTAutograd under ``torch.compile``)
records one node each, whatever the number of tokens, and a symbolic token count is not
specialised.  The caller's autocast dtype is read at the call and passed as an argument: the op
runs its matmuls under that autocast, exactly as the unfused linear would, also where a compiled
graph runs with autocast's state folded into its ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mambac.errors import MambacInputError
from mambac.ops._common import _tracing, autocast_dtype, kernels_enabled

CHUNK_FP32_BYTES = 2 ** 28   # one chunk's fp32 logits stay within 256 MiB


def default_chunk(vocab: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``CHUNK_FP32_BYTES``."""
    return max(1, CHUNK_FP32_BYTES // (4 * max(1, vocab)))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int):
    """(lse, target logit, valid mask) of one chunk, in the accumulation dtype."""
    z = logits.to(_acc_dtype(logits.dtype))
    lse = torch.logsumexp(z, dim=-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = z.gather(1, safe.unsqueeze(1)).squeeze(1)
    return lse, target, valid


def _use_kernels(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the generated softmax kernels run: kernels enabled for the device, no float64
    operand (autocast leaves float64 alone, so these dtypes decide the logits' dtype family), and
    real tensors (fake-tensor runs, such as the memory recorder's or a trace, take the PyTorch
    passes, which save the same tensors)."""
    from torch._guards import detect_fake_mode
    if not kernels_enabled(hidden.device):
        return False
    from mambac.codegen.kernel_ir import KERNEL_DTYPES
    return (hidden.dtype in KERNEL_DTYPES and weight.dtype in KERNEL_DTYPES
            and detect_fake_mode((hidden, weight)) is None)


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, use_kernels: bool):
    """(lse, summed loss terms, count of counted tokens) of one chunk."""
    if use_kernels:
        from mambac.codegen.lce_kernels import lce_stats
        lse, terms = lce_stats(logits, labels, ignore_index)
        return lse, terms.sum(), (labels != ignore_index).sum()
    lse, target, valid = _chunk_stats(logits, labels, ignore_index)
    return lse, torch.where(valid, lse - target, torch.zeros_like(lse)).sum(), valid.sum()


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, ignore_index: int,
                scale: torch.Tensor, use_kernels: bool) -> torch.Tensor:
    """``(softmax - onehot) * scale`` of one chunk (0 on ignored tokens), in the logits' dtype."""
    if use_kernels:
        from mambac.codegen.lce_kernels import lce_grad_
        return lce_grad_(logits, lse, labels, ignore_index, scale)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    # softmax - onehot, scaled, in place on one fp32 buffer (few passes over chunk x V)
    g = logits.to(lse.dtype)
    g.sub_(lse.unsqueeze(1)).exp_()
    g.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(g[:, :1]))
    g.mul_(torch.where(valid, scale.to(g.dtype), torch.zeros((), dtype=g.dtype, device=g.device))
           .unsqueeze(1))  # ignored tokens: 0
    return g.to(logits.dtype)


def _forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int, chunk: int,
             autocast: torch.dtype | None, use_kernels: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, per-token log-sum-exp, count of counted tokens), a chunk of logits at a time, under
    ``autocast`` (its dtype; None: off)."""
    n = hidden.shape[0]
    lses, total, count = [], None, None
    w = _cast_once(weight, autocast)
    with _autocast(hidden, autocast):
        for s in range(0, n, chunk):
            logits = F.linear(hidden[s:s + chunk], w)
            lse, part, cnt = _chunk_loss(logits, labels[s:s + chunk], ignore_index, use_kernels)
            total = part if total is None else total + part
            count = cnt if count is None else count + cnt
            lses.append(lse)
    lse_all = torch.cat(lses) if lses else hidden.new_zeros(0, dtype=_loss_dtype(hidden, weight))
    if total is None:  # no tokens: 0/0, as F.cross_entropy gives
        total = hidden.new_zeros((), dtype=_loss_dtype(hidden, weight))
        count = labels.new_zeros(())
    return total / count.to(total.dtype), lse_all, count


def _backward(grad_out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
              lse_all: torch.Tensor, ignore_index: int, chunk: int, autocast: torch.dtype | None,
              use_kernels: bool, need_h: bool, need_w: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d hidden, d weight): each chunk's logits recomputed, its gradient formed in place."""
    count = (labels != ignore_index).sum()   # counted again: cheaper than keeping it for backward
    scale = grad_out / count.to(grad_out.dtype)
    dhidden = torch.empty_like(hidden) if need_h else None
    dweight = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) if need_w else None
    w = _cast_once(weight, autocast)
    with _autocast(hidden, autocast):
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            g = _chunk_grad(F.linear(h, w), lse_all[s:s + chunk], labels[s:s + chunk], ignore_index, scale,
                            use_kernels)
            if need_h:
                dhidden[s:s + chunk] = torch.matmul(g, w).to(hidden.dtype)
            if need_w:
                dweight += torch.matmul(g.t(), h).to(dweight.dtype)
    return dhidden, (dweight.to(weight.dtype) if need_w else None)


def _loss_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 when an operand is fp64 (autocast leaves fp64 alone)."""
    return _acc_dtype(torch.promote_types(hidden.dtype, weight.dtype))


def _autocast(hidden: torch.Tensor, dtype: torch.dtype | None) -> torch.autocast:
    """Autocast to ``dtype`` on ``hidden``'s device (off for None), whatever is in force around."""
    return torch.autocast(hidden.device.type, dtype=dtype, enabled=dtype is not None)


@torch.library.custom_op("mambac::linear_cross_entropy", mutates_args=(),
                         schema="(Tensor hidden, Tensor weight, Tensor labels, int ignore_index, int chunk, "
                                "ScalarType? autocast_dtype) -> (Tensor, Tensor, Tensor)")
def _lce_op(hidden, weight, labels, ignore_index, chunk, autocast_dtype):
    loss, lse, count = _forward(hidden, weight, labels, ignore_index, chunk, autocast_dtype,
                                _use_kernels(hidden, weight))
    return loss, lse, count


@_lce_op.register_fake
def _lce_fake(hidden, weight, labels, ignore_index, chunk, autocast_dtype):
    dtype = _loss_dtype(hidden, weight)
    return hidden.new_empty((), dtype=dtype), hidden.new_empty(hidden.shape[:1], dtype=dtype), \
        labels.new_empty((), dtype=torch.int64)


@torch.library.custom_op("mambac::linear_cross_entropy_backward", mutates_args=(),
                         schema="(Tensor grad_out, Tensor hidden, Tensor weight, Tensor labels, Tensor lse, "
                                "int ignore_index, int chunk, ScalarType? autocast_dtype, "
                                "bool need_hidden, bool need_weight, bool use_kernels) -> (Tensor, Tensor)")
def _lce_backward_op(grad_out, hidden, weight, labels, lse, ignore_index, chunk, autocast_dtype,
                     need_hidden, need_weight, use_kernels):
    dh, dw = _backward(grad_out, hidden, weight, labels, lse, ignore_index, chunk,
                       autocast_dtype, use_kernels, need_hidden, need_weight)
    # a custom op returns tensors: an unwanted gradient is an empty one
    return (dh if dh is not None else hidden.new_empty(0)), (dw if dw is not None else weight.new_empty(0))


@_lce_backward_op.register_fake
def _lce_backward_fake(grad_out, hidden, weight, labels, lse, ignore_index, chunk, autocast_dtype,
                       need_hidden, need_weight, use_kernels):
    return (hidden.new_empty(hidden.shape) if need_hidden else hidden.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, labels, ignore_index, chunk, autocast_dtype = inputs
    _, lse, count = output
    ctx.save_for_backward(hidden, weight, labels, lse)
    ctx.args = (ignore_index, chunk, autocast_dtype)
    ctx.use_kernels = _use_kernels(hidden, weight)   # the forward's path (False on fake tensors)
    ctx.mark_non_differentiable(lse, count)


def _lce_backward(ctx, grad_loss, _grad_lse, _grad_count):
    hidden, weight, labels, lse = ctx.saved_tensors
    need_h, need_w = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
    if _tracing():   # one opaque node in the traced backward graph
        dh, dw = torch.ops.mambac.linear_cross_entropy_backward(grad_loss, hidden, weight, labels, lse,
                                                                 *ctx.args, need_h, need_w, ctx.use_kernels)
    else:
        ignore_index, chunk, autocast_dtype = ctx.args
        dh, dw = _backward(grad_loss, hidden, weight, labels, lse, ignore_index, chunk,
                           autocast_dtype, ctx.use_kernels, need_h, need_w)
    return (dh if need_h else None), (dw if need_w else None), None, None, None, None


_lce_op.register_autograd(_lce_backward, setup_context=_setup_context)


def _cast_once(weight: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The weight in the autocast dtype (None: autocast off), cast once per call (not once per
    chunk's matmul).  Like autocast itself, float64 stays float64."""
    castable = weight.is_floating_point() and weight.dtype not in (dtype, torch.float64)
    return weight.to(dtype) if dtype is not None and castable else weight


def _check(hidden, weight, labels, chunk) -> None:
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, labels)):
        raise MambacInputError("linear_cross_entropy takes tensors hidden (N, D), weight (V, D), labels (N,).")
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise MambacInputError(f"linear_cross_entropy wants hidden (N, D), weight (V, D), labels (N,); got "
                               f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(labels.shape)}. Flatten "
                               f"the batch and sequence dims first (hidden.flatten(0, -2), labels.flatten()).")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise MambacInputError(f"linear_cross_entropy: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} "
                               f"and labels {tuple(labels.shape)} disagree (need hidden (N, D), weight (V, D), "
                               f"labels (N,)).")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise MambacInputError(f"linear_cross_entropy: hidden and weight must be floating point, got "
                               f"{hidden.dtype} and {weight.dtype}.")
    if labels.dtype not in (torch.int64, torch.int32):
        raise MambacInputError(f"linear_cross_entropy: labels must be int64 (or int32) class ids, got {labels.dtype}.")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise MambacInputError(f"linear_cross_entropy: chunk must be a positive int (tokens per chunk), got {chunk!r}.")


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         chunk: int | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Mean ``cross_entropy(hidden @ weight.T, labels, ignore_index=ignore_index)`` over the tokens
    whose label is not ``ignore_index`` (nan when there are none, like ``F.cross_entropy``), never
    holding more than ``chunk`` tokens' logits (default: ``default_chunk(V)``, ≤ 256 MiB of fp32).
    A 0-dim tensor in fp32 (fp64 for fp64 inputs).  Bias-free linear only."""
    if bias is not None:
        raise MambacInputError("linear_cross_entropy supports a bias-free linear only (nn.Linear(..., bias=False)); "
                               "add the bias to the logits and call F.cross_entropy instead.")
    chunk = default_chunk(weight.shape[0]) if chunk is None and isinstance(weight, torch.Tensor) else chunk
    _check(hidden, weight, labels, chunk)
    if labels.dtype != torch.int64:
        labels = labels.long()
    return torch.ops.mambac.linear_cross_entropy(hidden, weight, labels, int(ignore_index), chunk,
                                                 autocast_dtype(hidden.device.type))[0]
