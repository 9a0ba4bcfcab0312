"""Tensor-parallel (optionally sequence-, context- and data-parallel) training of a Mamba-2 LM.

Launch with ``mambac run -n 4 examples/train_tensor_parallel.py --tp 2 --cp 2`` (tp x cp), or
``--tp 2 --dp 2``, or ``--cp 4`` (or torchrun).
Every rank passes the same full batch; the loss is the global mean; gradients are clipped with the
unsharded model's norm; the final unsharded state dict is saved by rank 0.
"""
from __future__ import annotations

import argparse
import os

import torch

import mambac
from mambac.models import MambaConfig, MambaLMHeadModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", type=int, default=None)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks: the sequence split over them")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save", default="")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MambaLMHeadModel(MambaConfig(d_model=64, n_layer=2, vocab_size=64,
                                         ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, ngroups=2,
                                                      chunk_size=16)))
    lm = mambac.compile(model, world_size=world, tp=args.tp, dp=args.dp, cp=args.cp,
                        sequence_parallel=args.sequence_parallel)
    opt = torch.optim.AdamW(lm.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank
    data = torch.randint(0, 64, (8, 33), generator=gen)
    losses = []
    for _ in range(args.steps):
        loss = lm(data[:, :-1], data[:, 1:])
        opt.zero_grad()
        loss.backward()
        mambac.clip_grad_norm_(lm, 1.0)
        opt.step()
        losses.append(loss.item())
    state = lm.state_dict()  # unsharded; every rank takes part
    if rank == 0:
        print(f"world {world} (tp={lm.options.tp}, dp={lm.options.dp}, cp={lm.options.cp}): loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if args.save:
            torch.save(state, args.save)
    return 0 if losses[-1] < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
