"""``mambac::causal_conv1d``: depthwise causal 1-D convolution with optional SiLU.

Layout follows mamba_ssm's ``causal_conv1d_fn``: x is (batch, dim, seqlen), weight (dim, width),
bias (dim,).  ``initial_state`` (batch, dim, width-1) holds the inputs that precede x (zeros when
absent); the op always returns the final conv state, the last width-1 inputs of
``cat(initial_state, x)``, which is what a following segment (decoding, or the next rank under
context parallelism) needs as its initial state.

Returns ``(y, final_state)``; y has x's dtype and shape.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from mambac.ops._common import (OpInfo, check, check_float, check_shape, compute_dtype,
                                register_info, register_recompute_autograd)

ACTIVATIONS = ("none", "silu")


def reference(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
              activation: str) -> tuple[Tensor, Tensor]:
    """Plain-PyTorch causal conv: pad on the left with the initial state, depthwise conv1d."""
    width = weight.shape[1]
    ct = compute_dtype(x)
    xc = x.to(ct)
    if initial_state is None:
        pre = xc.new_zeros(x.shape[0], x.shape[1], width - 1)
    else:
        pre = initial_state.to(ct)
    full = torch.cat([pre, xc], dim=-1)
    y = F.conv1d(full, weight.to(ct).unsqueeze(1), None if bias is None else bias.to(ct),
                 groups=x.shape[1])
    if activation == "silu":
        y = F.silu(y)
    final = full[..., full.shape[-1] - (width - 1):]
    return y.to(x.dtype), final.to(x.dtype)


def output_like(x: Tensor) -> Tensor:
    """An empty (b, d, L) tensor laid out as ``x`` is: channels innermost when x's channels are
    (a transposed (b, L, d) tensor, as the mixers pass it: y then transposes back to a dense
    (b, L, d) and the backward's dx to the dense gradient of the projection), else dense (b, d, L)."""
    b, d, l = x.shape
    if d > 1 and l > 1 and x.stride(1) == 1:
        return x.new_empty(b, l, d).transpose(1, 2)
    return x.new_empty(b, d, l)


@torch.library.custom_op("mambac::causal_conv1d", mutates_args=())
def causal_conv1d_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                     activation: str) -> tuple[Tensor, Tensor]:
    y, final = reference(x, weight, bias, initial_state, activation)
    return output_like(x).copy_(y), final.contiguous()


@causal_conv1d_op.register_fake
def _fake(x, weight, bias, initial_state, activation):
    return output_like(x), x.new_empty(x.shape[0], x.shape[1], weight.shape[1] - 1)


register_recompute_autograd(causal_conv1d_op, reference, n_outputs=2)

INFO = register_info(OpInfo(
    name="causal_conv1d", op=torch.ops.mambac.causal_conv1d, reference=reference,
    arg_names=("x", "weight", "bias", "initial_state", "activation"), n_outputs=2, doc=__doc__ or ""))


def validate(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
             activation: str) -> None:
    check_float("causal_conv1d", x=x, weight=weight, bias=bias, initial_state=initial_state)
    check(x.dim() == 3, "causal_conv1d", f"x must be (batch, dim, seqlen), got shape {tuple(x.shape)}.")
    check_shape("causal_conv1d", "weight", weight, (x.shape[1], None))
    check(weight.shape[1] >= 1, "causal_conv1d", "weight needs a width of at least 1.")
    check_shape("causal_conv1d", "bias", bias, (x.shape[1],))
    check_shape("causal_conv1d", "initial_state", initial_state, (x.shape[0], x.shape[1], weight.shape[1] - 1))
    check(activation in ACTIVATIONS, "causal_conv1d",
          f"activation must be one of {ACTIVATIONS}, got {activation!r}.")


def causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                  initial_state: Optional[Tensor] = None, activation: Optional[str] = None,
                  return_final_state: bool = False):
    """Depthwise causal conv1d over (batch, dim, seqlen); see the module docstring."""
    act = "none" if activation is None else activation
    if not isinstance(x, torch.fx.Proxy):
        validate(x, weight, bias, initial_state, act)
    y, final = torch.ops.mambac.causal_conv1d(x, weight, bias, initial_state, act)
    return (y, final) if return_final_state else y
