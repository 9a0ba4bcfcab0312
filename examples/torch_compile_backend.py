"""Train with ``torch.compile(model, backend="mambac")``: the ordinary PyTorch loop, mambac's
passes applied to the graphs dynamo captures.

    python examples/torch_compile_backend.py [--steps N]
"""
from __future__ import annotations

import argparse

import torch

from mambac.models import MambaConfig, MambaLMHeadModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=64, n_layer=2, vocab_size=64,
                                         ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=16)))
    compiled = torch.compile(model, backend="mambac")      # found through the entry point
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 64, (8, 33))
    first = None
    for step in range(args.steps):
        loss = compiled(data[:, :-1], data[:, 1:])           # memorise one fixed batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    print(f"loss {first:.3f} -> {loss.item():.3f} after {args.steps} steps")
    return 0 if loss.item() < first else 1


if __name__ == "__main__":
    raise SystemExit(main())
