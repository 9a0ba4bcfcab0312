"""Long-context training with context parallelism: the sequence split over every rank.

Launch with ``mambac run -n 4 examples/train_long_context.py --seqlen 65536``.  Each rank reads
only its own piece of every sequence (``cp_inputs="local"``), so no rank ever holds the whole
sequence's activations; the scans pass a small state between ranks (its size does not depend on the
length) and the loss is the mean over the whole sequence.  Prints the saved activations per rank
(measured with saved-tensor hooks) and the throughput.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch._subclasses.fake_tensor import FakeTensor

import mambac
from mambac.models import MambaConfig, MambaLMHeadModel
from mambac.runtime.collectives import split_sizes, split_start


def saved_bytes_during(fn) -> tuple[object, int]:
    """Run ``fn`` and count the bytes of the distinct storages autograd saves for backward."""
    seen: dict[int, int] = {}

    def pack(t):
        if not isinstance(t, FakeTensor):  # the first call also lowers the program (on fake tensors)
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=64)
    args = ap.parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)  # the same initial weights on every rank
    model = MambaLMHeadModel(MambaConfig(d_model=args.d_model, n_layer=2, vocab_size=256,
                                         ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=64)),
                             device=device)
    lm = mambac.compile(model, world_size=world, cp=world, cp_inputs="local")
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    # this rank's piece of each sequence: in a real job, read only these tokens from disk
    start, size = split_start(args.seqlen, world, rank), split_sizes(args.seqlen, world)[rank]
    gen = torch.Generator().manual_seed(1)
    t0, losses, saved = None, [], 0
    for step in range(args.steps):
        tokens = torch.randint(0, 256, (args.batch, args.seqlen + 1), generator=gen)  # the data set
        ids = tokens[:, start:start + size].to(device)              # inputs: tokens start .. start+size-1
        labels = tokens[:, start + 1:start + size + 1].to(device)   # targets: the next tokens
        loss, saved = saved_bytes_during(lambda: lm(ids, labels))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - t0 if args.steps > 1 else float("nan")
    tokens_per_s = args.batch * args.seqlen * (args.steps - 1) / elapsed if args.steps > 1 else float("nan")
    if rank == 0:
        print(f"cp={lm.options.cp}: sequence {args.seqlen} split into pieces of {split_sizes(args.seqlen, world)}; "
              f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; saved activations per rank {saved / 2**20:.1f} MiB; "
              f"{tokens_per_s:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
