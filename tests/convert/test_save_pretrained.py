"""``MambaLMHeadModel.save_pretrained`` / ``from_pretrained``: mamba_ssm's checkpoint directory,
written atomically and read back to the same model."""
from __future__ import annotations

import json

import pytest
import torch

import mambac
from mambac.errors import MambacInputError
from mambac.models import MambaLMHeadModel
from tests.models.tiny import tiny_lm

# the fields of mamba_ssm's MambaConfig (mamba_ssm/models/config_mamba.py), which its
# from_pretrained passes to MambaConfig(**config): any other key is a TypeError there
MAMBA_SSM_FIELDS = {"d_model", "d_intermediate", "n_layer", "vocab_size", "ssm_cfg", "attn_layer_idx", "attn_cfg",
                    "rms_norm", "residual_in_fp32", "fused_add_norm", "pad_vocab_size_multiple", "tie_embeddings"}


@pytest.mark.parametrize("name", ["mamba1", "mamba2_oddheads_normbeforegate_mlp", "mamba3_mimo_outnorm"])
def test_round_trip_gives_the_same_model_in_mamba_ssms_format(name, tmp_path):
    model = tiny_lm(name)
    model.save_pretrained(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert set(config) == MAMBA_SSM_FIELDS and config["ssm_cfg"] == model.config.ssm_cfg
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "pytorch_model.bin"]
    back = MambaLMHeadModel.from_pretrained(tmp_path / "ckpt")
    ids = torch.randint(0, 37, (2, 11))
    assert torch.equal(back(ids), model(ids))
    assert back.lm_head.weight is back.backbone.embedding.weight   # the tie survives
    assert torch.equal(mambac.compile(str(tmp_path / "ckpt"))(ids), model(ids))
    half = MambaLMHeadModel.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16


def test_a_norm_epsilon_mamba_ssm_cannot_hold_is_kept_for_mambac(tmp_path):
    model = tiny_lm("mamba2", norm_epsilon=1e-6)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["norm_epsilon"] == 1e-6
    assert MambaLMHeadModel.from_pretrained(tmp_path).config.norm_epsilon == 1e-6


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    old, new = tiny_lm("mamba2", seed=0), tiny_lm("mamba2", seed=1)
    old.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def dies(obj, path, *a, **k):
        open(path, "wb").write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", dies)
    with pytest.raises(OSError, match="disk full"):
        new.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before   # no temporary file left either


def test_bad_paths_and_arguments_are_clear(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(MambacInputError, match="is a file; save_pretrained writes a directory"):
        tiny_lm("mamba2").save_pretrained(tmp_path / "file")
    with pytest.raises(MambacInputError, match=r"takes \(path, device=None, dtype=None\)"):
        MambaLMHeadModel.from_pretrained(tmp_path, revision="main")
