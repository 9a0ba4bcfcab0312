"""GPU tier: the generated conv / norm / SSD kernels through ``mambac.ops`` on CUDA (mode 'auto'),
against each op's reference in float64, and a small compiled Mamba-2 LM (kernels 'auto' vs
'reference') in bf16 autocast.  Run on a CUDA machine with the Triton interpreter off:

    python -c "import triton, pytest, sys; sys.exit(pytest.main(['tests/codegen/test_kernels_gpu.py']))"

(Triton imported first, so ``tests/codegen/conftest.py`` leaves the interpreter off.)
"""
from __future__ import annotations


import pytest
import torch

import mambac
from mambac.ops import add_rmsnorm, causal_conv1d, gated_rmsnorm, ssd
from tests.codegen.test_kernel_wiring import MINE, counting
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu]
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def _compare(fn, inputs, dtype, seed=0):
    """fn on ``inputs`` (cuda, dtype) vs fn on float64 copies (the reference runs for float64)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cast = [t.detach().to(dtype).requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs]
    ref = [t.detach().double().requires_grad_() if isinstance(t, torch.Tensor) else t for t in cast]
    outs, routs = fn(*cast), fn(*ref)
    outs = outs if isinstance(outs, tuple) else (outs,)
    routs = routs if isinstance(routs, tuple) else (routs,)
    cots = [torch.randn(o.shape, device="cuda", generator=gen, dtype=torch.float32) for o in outs]
    sum((o.float() * c).sum() for o, c in zip(outs, cots)).backward()
    sum((o * c.double()).sum() for o, c in zip(routs, cots)).backward()
    errs = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, routs))}
    errs.update({f"grad{i}": rel_err(a.grad, b.grad) for i, (a, b) in enumerate(zip(cast, ref))
                 if isinstance(a, torch.Tensor)})
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    assert not bad, (bad, errs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_and_norms_on_cuda(dtype):
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    _compare(lambda x, w, b, i: causal_conv1d(x, w, b, i, "silu", return_final_state=True),
             [r(3, 1000, 77).transpose(1, 2), r(77, 4), r(77), r(3, 77, 3)], dtype)
    _compare(lambda x, w, z: gated_rmsnorm(x, w, z, group_size=48), [r(5, 123, 96), r(96), r(5, 123, 96)], dtype)
    _compare(lambda x, w, z: gated_rmsnorm(x, w, z, group_size=96, norm_before_gate=True),
             [r(5, 123, 96), r(96), r(5, 123, 96)], dtype)
    _compare(lambda x, res, w: add_rmsnorm(x, res, w, residual_in_fp32=True), [r(7, 131, 768), r(7, 131, 768),
                                                                              r(768)], dtype)


def test_ssd_on_cuda_bf16():
    r = lambda *s: torch.randn(*s, device="cuda")  # noqa: E731
    b, l, h, p, n, g = 2, 300, 4, 32, 64, 2
    _compare(lambda x, dt, A, B, C, D, z, bias: ssd(x, dt, A, B, C, chunk_size=64, D=D, z=z, dt_bias=bias,
                                                     dt_softplus=True),
             [r(b, l, h, p), r(b, l, h) * 0.5 - 1, -torch.rand(h, device="cuda") - 0.5, r(b, l, g, n),
              r(b, l, g, n), r(h), r(b, l, h, p), r(h) * 0.3], torch.bfloat16)


def test_compiled_lm_auto_matches_reference():
    """fp32: logits' loss and every parameter gradient; bf16 autocast: the loss (gradients of a
    bf16 run differ from the fp32-internal reference by bf16 rounding, amplified by cancellation)."""
    from mambac.models import MambaConfig, MambaLMHeadModel
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=128, n_layer=2, vocab_size=300, ssm_cfg=dict(
        layer="Mamba2", d_state=32, headdim=32, chunk_size=32))).cuda()
    ids = torch.randint(0, 300, (2, 129), device="cuda")
    out = {}
    for mode in ("auto", "reference"):
        lm = mambac.compile(model, kernels=mode)
        with counting() as calls:
            loss = lm(ids[:, :-1], ids[:, 1:])
            loss.backward()
        ran = {name for name, _ in calls}
        assert ran == (set(MINE) if mode == "auto" else set()), (mode, dict(calls))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_bf16 = lm(ids[:, :-1], ids[:, 1:]).detach()
        out[mode] = (loss.detach(), loss_bf16, {n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
    assert rel_err(out["auto"][0], out["reference"][0]) < 1e-5
    assert rel_err(out["auto"][1], out["reference"][1]) < 1e-2
    errs = {n: rel_err(out["auto"][2][n], g) for n, g in out["reference"][2].items()}
    assert max(errs.values()) < 1e-3, errs


@pytest.mark.parametrize("b,l,h", [(2, 1000, 6), (1, 4100, 3)])
def test_fused_forward_path_on_cuda(b, l, h):
    """The one-launch forward (flag hand-over between chunk programs) against the three launches
    and the float64 reference, at lengths that leave a partial last chunk, with an initial state."""
    import math
    from mambac.codegen import ssd_kernels as fk
    gen = torch.Generator(device="cuda").manual_seed(b * l + h)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    p, n, g, q = 64, 128, 1, 256
    x, dt, A = r(b, l, h, p), r(b, l, h) * 0.5 - 1, -torch.rand(h, device="cuda", generator=gen) - 0.5
    B, C, D, z, bias, init = r(b, l, g, n), r(b, l, g, n), r(h), r(b, l, h, p), r(h) * 0.3, r(b, h, p, n)
    args = [x.bfloat16(), dt, A, B.bfloat16(), C.bfloat16(), D, z.bfloat16(), bias, init]
    pr = fk.prepare(*args, q, True, 0.0, math.inf)
    y, final, saved = fk.forward_prepared(pr, path="fused")
    y3, final3, saved3 = fk.forward_prepared(pr, path="three")
    ref = ssd(*[a.double() for a in args[:5]], chunk_size=q, D=D.double(), z=args[6].double(),
              dt_bias=bias.double(), initial_state=init.double(), dt_softplus=True,
              return_final_state=True)
    assert rel_err(y, ref[0]) < 1e-2 and rel_err(final, ref[1]) < 1e-2
    assert rel_err(y, y3) < 1e-2 and rel_err(final, final3) < 1e-4 and rel_err(saved.sin, saved3.sin) < 1e-2


def test_state_walks_on_cuda():
    """The forward's and the backward's state walks (TMA loads, an EVEN length) against the
    per-chunk states with their passing and the float64 reference, with an initial state and two
    groups; the autotune timer's CUDA-graph replay measures a positive time for them.  Before
    compute capability 9.0 the walk is refused and the default is the per-chunk states."""
    import math
    from mambac import knobs
    from mambac.codegen import autotune, ssd_backward
    from mambac.codegen import ssd_kernels as fk
    gen = torch.Generator(device="cuda").manual_seed(7)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    b, l, h, p, n, g, q = 2, 1024, 4, 64, 128, 2, 256
    args = [r(b, l, h, p).bfloat16(), r(b, l, h) * 0.5 - 1, -torch.rand(h, device="cuda", generator=gen) - 0.5,
            r(b, l, g, n).bfloat16(), r(b, l, g, n).bfloat16(), r(h), None, r(h) * 0.3, r(b, h, p, n)]
    pr = fk.prepare(*args, q, True, 0.0, math.inf)
    if torch.cuda.get_device_capability()[0] < 9:   # no TMA: the walk is refused, the default falls back
        assert fk.choose_walk(pr) == "three"
        with pytest.raises(ValueError, match="use path='three'"):
            fk.forward_prepared(pr, path="walk")
        return
    assert fk.walk_fits(pr.dims)
    y, final, saved = fk.forward_prepared(pr, path="walk")
    y3, final3, saved3 = fk.forward_prepared(pr, path="three")
    ref = ssd(*[a.double() for a in args[:5]], chunk_size=q, D=args[5].double(), dt_bias=args[7].double(),
              initial_state=args[8].double(), dt_softplus=True, return_final_state=True)
    errs = dict(y=rel_err(y, ref[0]), final=rel_err(final, ref[1]), y3=rel_err(y, y3),
                final3=rel_err(final, final3), sin=rel_err(saved.sin, saved3.sin))
    assert max(errs.values()) < 1e-2, errs
    gy = r(b, l, h, p).bfloat16()
    grads = {}
    for walk in ("1", "0"):
        with knobs.override(ssd_walk=walk):
            grads[walk] = ssd_backward(gy, None, *args, q, True, 0.0, math.inf)
    for name, a, c in zip(("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "init"), grads["1"], grads["0"]):
        if a is not None:
            assert rel_err(a, c) < 1e-2, (name, rel_err(a, c))
    assert autotune.graph_ms(lambda: fk.run_state_walk(pr)) > 0
