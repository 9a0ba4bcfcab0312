"""Parity with the real mamba_ssm modules (GPU tier).

mamba_ssm is imported from ``.bench_deps/`` at the repository root.  Where its optional CUDA
extensions are not built, its modules are run on their own pure-PyTorch fallbacks: the conv falls
back to ``nn.Conv1d`` by itself, Mamba-2 takes its unfused path (``use_mem_eff_path=False``) and
Mamba-1's scan is mamba_ssm's ``selective_scan_ref``.  Everything else is mamba_ssm's Triton code.
"""
import sys
from pathlib import Path

import pytest
import torch

import mambac
from mambac.convert import convert, original_state_dict
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
TOL_OUT, TOL_GRAD = 2e-3, 1e-2
# mamba_ssm's Mamba-3 SISO kernel casts q, k, v, z, trap and angles to bf16 whatever the input dtype
TOL_BF16_OUT, TOL_BF16_GRAD = 2e-2, 5e-2


@pytest.fixture(scope="module")
def mamba_ssm():
    sys.path.insert(0, str(ROOT / ".bench_deps"))
    torch.backends.cuda.matmul.allow_tf32 = False
    import mamba_ssm
    from mamba_ssm.modules import mamba_simple
    from mamba_ssm.ops import selective_scan_interface as ssi

    if ssi.selective_scan_cuda is None:  # no CUDA extension: mamba_ssm's own reference scan
        mamba_simple.selective_scan_fn = ssi.selective_scan_ref
    return mamba_ssm


def _has_causal_conv1d() -> bool:
    try:
        import causal_conv1d  # noqa: F401
    except ImportError:
        return False
    return True


def _compare(module, compiled, args, params, tol=(TOL_OUT, TOL_GRAD)) -> None:
    ref = module(*args)
    ref = ref.logits if hasattr(ref, "logits") else ref
    out = compiled(*args)
    assert rel_err(out, ref) <= tol[0]
    cot = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * cot).sum(), params)
    g_out = torch.autograd.grad((out * cot).sum(), params)
    for i, (a, b) in enumerate(zip(g_out, g_ref)):
        assert rel_err(a, b) <= tol[1], i


def _mixer(mamba_ssm, name: str):
    fast = _has_causal_conv1d()
    if name == "mamba1":
        return mamba_ssm.Mamba(64, d_state=16, use_fast_path=False)
    if name == "mamba2":
        return mamba_ssm.Mamba2(64, d_state=32, headdim=16, ngroups=2, chunk_size=32, use_mem_eff_path=fast)
    return mamba_ssm.Mamba3(64, d_state=32, headdim=16, chunk_size=32)


@pytest.mark.parametrize("name", ["mamba1", "mamba2", "mamba3_siso"])
def test_bare_mixer_matches_mamba_ssm(mamba_ssm, name):
    torch.manual_seed(0)
    module = _mixer(mamba_ssm, name).cuda()
    converted = convert(module)
    assert set(original_state_dict(converted)) == set(module.state_dict())
    x = torch.randn(2, 100, 64, device="cuda")
    params = list(module.parameters())
    tol = (TOL_BF16_OUT, TOL_BF16_GRAD) if name.startswith("mamba3") else (TOL_OUT, TOL_GRAD)
    _compare(module, converted, (x,), params, tol)
    _compare(module, mambac.compile(module), (x,), params, tol)


def _lm(mamba_ssm, layer: str):
    from mamba_ssm.models.config_mamba import MambaConfig

    ssm = dict(layer=layer, d_state=16)
    if layer == "Mamba2":
        ssm.update(headdim=16, chunk_size=32, use_mem_eff_path=_has_causal_conv1d())
    cfg = MambaConfig(d_model=64, n_layer=2, vocab_size=101, d_intermediate=96 if layer == "Mamba2" else 0,
                      ssm_cfg=ssm, pad_vocab_size_multiple=8)
    torch.manual_seed(0)
    return mamba_ssm.MambaLMHeadModel(cfg, device="cuda")


@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_lm_and_its_checkpoint_match_mamba_ssm(mamba_ssm, layer, tmp_path):
    model = _lm(mamba_ssm, layer)
    ids = torch.randint(0, 101, (2, 64), device="cuda")
    _compare(model, mambac.compile(model, example_inputs=(ids,)), (ids,), list(model.parameters()))
    assert set(original_state_dict(convert(model))) == set(model.state_dict())
    model.save_pretrained(str(tmp_path))  # mamba_ssm's own writer: config.json + pytorch_model.bin
    loaded = mambac.from_pretrained(tmp_path, device="cuda")
    with torch.no_grad():
        assert rel_err(loaded(ids), model(ids).logits) <= TOL_OUT
