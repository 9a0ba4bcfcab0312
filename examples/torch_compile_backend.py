"""Train with ``torch.compile(model, backend="mambac")``: the ordinary PyTorch loop, mambac's
passes applied to the graphs dynamo captures.

    python examples/torch_compile_backend.py [--steps N]
    mambac run -n 2 examples/torch_compile_backend.py [--cp 2]    # tensor (or context) parallel

Under a launcher every rank runs this same script on the same batch; the backend shards the model
over the ranks (tp = world size / cp) and every rank's parameters take the same, whole gradients.
"""
from __future__ import annotations

import argparse
import os

import torch

from mambac.models import MambaConfig, MambaLMHeadModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks when launched on several")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    options = {"world_size": world, "cp": args.cp} if world > 1 else {}
    torch.manual_seed(0)
    model = MambaLMHeadModel(MambaConfig(d_model=64, n_layer=2, vocab_size=64,
                                         ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=16)))
    compiled = torch.compile(model, backend="mambac", options=options)  # found through the entry point
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 64, (8, 33))
    first = None
    for step in range(args.steps):
        loss = compiled(data[:, :-1], data[:, 1:])           # memorise one fixed batch
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    if os.environ.get("RANK", "0") == "0":
        where = f" on {world} ranks" if world > 1 else ""
        print(f"loss {first:.3f} -> {loss.item():.3f} after {args.steps} steps{where}")
    return 0 if loss.item() < first else 1


if __name__ == "__main__":
    raise SystemExit(main())
