"""The device-kernel interface of ``mambac.ops`` and the compiled module's kernel mode, end to end
under the Triton interpreter: ops called through ``torch.ops.mambac`` run the generated kernels
(forward and backward) in mode 'triton', the reference otherwise, and a tiny Mamba-2 LM compiled
with kernels='triton' matches kernels='reference' in logits and gradients."""
from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import mambac
from mambac.errors import MambacInputError
from mambac.ops import (causal_conv1d, gated_rmsnorm, kernel_mode, kernels_enabled, register_device_kernels,
                        registered_device_kernels, use_kernels)
from mambac.ops._common import _DEVICE_KERNELS
from tests.helpers import rel_err
from tests.models.tiny import tiny_lm

MINE = ("ssd", "causal_conv1d", "gated_rmsnorm", "add_rmsnorm")


@contextlib.contextmanager
def counting(names=MINE):
    """Wrap the registered kernels of ``names`` to count forward and backward calls."""
    calls: Counter = Counter()
    saved = {k: v for k, v in registered_device_kernels().items() if k[0] in names}
    assert {k[0] for k in saved} == set(names), saved.keys()
    for (name, dev), ks in saved.items():
        def fwd(*a, _f=ks.forward, _n=name):
            calls[_n, "fwd"] += 1
            return _f(*a)

        def bwd(args, grads, needs, _b=ks.backward, _n=name):
            calls[_n, "bwd"] += 1
            return _b(args, grads, needs)
        register_device_kernels(name, dev, forward=fwd, backward=bwd, supports=ks.supports)
    try:
        yield calls
    finally:
        _DEVICE_KERNELS.update(saved)


def test_mode_switch_and_errors():
    assert kernel_mode() == "auto"
    with use_kernels("reference"):
        assert kernel_mode() == "reference" and not kernels_enabled("cuda")
        with use_kernels("triton"):
            assert kernels_enabled("cpu")  # the tests run under TRITON_INTERPRET=1
        assert kernel_mode() == "reference"
    assert not kernels_enabled("cpu")  # 'auto': CPU tensors take the reference
    with pytest.raises(MambacInputError, match="kernel mode must be one of"):
        with use_kernels("fast"):
            pass
    with pytest.raises(MambacInputError, match="no op named 'nope'"):
        register_device_kernels("nope", forward=lambda *a: a)
    with pytest.raises(MambacInputError, match="device must be one of"):
        register_device_kernels("ssd", "tpu", forward=lambda *a: a)
    with pytest.raises(MambacInputError, match="give a forward, a backward or both"):
        register_device_kernels("ssd")


@pytest.mark.interp
def test_ops_dispatch_by_mode_dtype_and_forward_time_mode():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 11, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, requires_grad=True)
    with counting() as calls:
        y_ref = causal_conv1d(x, w, activation="silu")                  # auto on CPU: reference
        with use_kernels("triton"):
            y = causal_conv1d(x, w, activation="silu")
            y64 = causal_conv1d(x.double(), w.double())              # float64: reference
        assert calls == Counter({("causal_conv1d", "fwd"): 1})
        gx, gw = torch.autograd.grad(y.sum(), [x, w])  # outside the block: the forward's mode decides
        assert calls[("causal_conv1d", "bwd")] == 1
        rx, rw = torch.autograd.grad(y_ref.sum(), [x, w])
        with use_kernels("triton"):
            torch.autograd.grad(y64.sum(), [x, w])
        assert calls[("causal_conv1d", "bwd")] == 1
    assert rel_err(y, y_ref) < 1e-5 and rel_err(gx, rx) < 1e-5 and rel_err(gw, rw) < 1e-5
    # a registration without a backward keeps the exact recompute rule for gradients
    z = torch.randn(4, 12, generator=gen, requires_grad=True)
    keep = dict(_DEVICE_KERNELS)
    try:
        ks = _DEVICE_KERNELS[("gated_rmsnorm", "cuda")]
        register_device_kernels("gated_rmsnorm", forward=ks.forward, supports=ks.supports)
        with use_kernels("triton"):
            out = gated_rmsnorm(z, torch.ones(12), group_size=4)
        (g,) = torch.autograd.grad(out.sum(), [z])
    finally:
        _DEVICE_KERNELS.clear()
        _DEVICE_KERNELS.update(keep)
    (g_ref,) = torch.autograd.grad(gated_rmsnorm(z, torch.ones(12), group_size=4).sum(), [z])
    assert rel_err(g, g_ref) < 1e-5


def _run(compiled, ids, labels):
    logits = compiled(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    grads = {n: p.grad.clone() for n, p in compiled.named_parameters() if p.grad is not None}
    compiled.zero_grad(set_to_none=True)
    return logits.detach(), grads


@pytest.mark.interp
@pytest.mark.parametrize("variant", ["mamba2_oddheads_normbeforegate_mlp"])
def test_tiny_mamba2_lm_triton_matches_reference(variant):
    model = tiny_lm(variant, n_layer=2)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 37, (2, 10), generator=gen)
    labels = torch.randint(0, 37, (2, 10), generator=gen)
    ref_logits, ref_grads = _run(mambac.compile(model, kernels="reference"), ids, labels)
    with counting() as calls:
        logits, grads = _run(mambac.compile(model, kernels="triton"), ids, labels)
    for name in MINE:  # every op of the model ran its generated forward and backward
        assert calls[name, "fwd"] > 0 and calls[name, "bwd"] > 0, (name, dict(calls))
    assert rel_err(logits, ref_logits) < 1e-4
    assert grads.keys() == ref_grads.keys() and grads
    bad = {n: rel_err(grads[n], ref_grads[n]) for n in grads if not rel_err(grads[n], ref_grads[n]) < 1e-4}
    assert not bad, bad



@pytest.mark.interp
def test_bf16_lm_on_the_generated_kernels():
    """A bf16 model (fp32 residual stream) on the generated kernels: every op runs its kernels, and
    logits and gradients are as close to a float64 copy as the reference ops in bf16 are."""
    import copy

    m64 = tiny_lm("mamba2", seed=3, n_layer=2).double()
    model = copy.deepcopy(m64).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 37, (2, 10), generator=gen)
    labels = torch.randint(0, 37, (2, 10), generator=gen)
    want_logits, want = _run(m64, ids, labels)
    ref_logits, ref = _run(mambac.compile(model, kernels="reference"), ids, labels)
    with counting() as calls:
        logits, grads = _run(mambac.compile(model, kernels="triton"), ids, labels)
    assert calls["add_rmsnorm", "fwd"] > 0 and calls["ssd", "bwd"] > 0, dict(calls)
    assert logits.dtype == torch.bfloat16
    assert rel_err(logits, want_logits) <= 2 * rel_err(ref_logits, want_logits) + 1e-3
    worst = max(rel_err(grads[n], want[n]) for n in grads)
    worst_ref = max(rel_err(ref[n], want[n]) for n in ref)
    assert worst <= 2 * worst_ref + 1e-2, (worst, worst_ref)
