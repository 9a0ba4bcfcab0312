"""Compile a Hugging Face transformers Mamba-2 checkpoint directory with mambac.

Makes a small random-weight ``Mamba2ForCausalLM``, saves it with ``save_pretrained`` (as a
downloaded checkpoint would be laid out), loads the directory with ``mambac.compile(path)`` — no
transformers import needed for that step — and checks logits against transformers' own forward.

    python examples/compile_hf_checkpoint.py [--dir DIR] [--layers N]
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import mambac


def make_checkpoint(path: str, layers: int) -> torch.nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(vocab_size=100, hidden_size=64, num_hidden_layers=layers, state_size=16, head_dim=16,
                       num_heads=8, n_groups=2, expand=2, chunk_size=16)
    torch.manual_seed(0)
    hf = Mamba2ForCausalLM(cfg).eval()
    hf.save_pretrained(path)
    return hf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.dir or tmp
        hf = make_checkpoint(path, args.layers)
        compiled = mambac.compile(path)                      # loads config.json + model.safetensors
        ids = torch.randint(0, 100, (2, 40))
        with torch.no_grad():
            ours, theirs = compiled(ids), hf(ids).logits
        err = ((ours - theirs).norm() / theirs.norm()).item()
        print(f"compiled {path}: logits {tuple(ours.shape)}, rel err vs transformers {err:.1e}")
        return 0 if err <= 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
