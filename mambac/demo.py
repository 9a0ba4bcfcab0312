"""The main job (``make demo``): build the reference Mamba-2 LM, compile it, check it against
eager (logits and gradients), and print the lowered graph.  Runs on the CPU by default."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import mambac
from mambac.presets import build_preset


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mambac demo", description=__doc__)
    ap.add_argument("--preset", default="mamba2-tiny")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--graph-out", default="mambac_demo_graph.txt", help="file the lowered graph is written to")
    args = ap.parse_args(argv)

    model = build_preset(args.preset, device=args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {args.preset} ({n_params / 1e6:.2f}M parameters) on {args.device}")
    t0 = time.perf_counter()
    compiled = mambac.compile(model, world_size=1)
    print(f"compiled in {time.perf_counter() - t0:.2f} s")
    program = next(iter(compiled.programs.values()))
    for name, stats in program.ctx.stats.items():
        print(f"  pass {name:22s} {program.ctx.timings.get(name, 0) * 1e3:7.1f} ms  {stats.counts}")

    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seqlen), device=args.device)
    labels = torch.randint(0, model.config.vocab_size, (args.batch, args.seqlen), device=args.device)
    params = list(model.parameters())
    loss_e = model(ids, labels)
    loss_c = compiled(ids, labels)
    ge = torch.autograd.grad(loss_e, params)
    gc = torch.autograd.grad(loss_c, params)
    logit_err = _rel(compiled(ids), model(ids))
    grad_err = max(_rel(a, b) for a, b in zip(gc, ge))
    ok = logit_err <= 1e-5 and grad_err <= 1e-5
    print(f"parity vs eager: logits rel err {logit_err:.2e}, worst parameter-gradient rel err {grad_err:.2e} "
          f"-> {'OK' if ok else 'MISMATCH'}")
    text = compiled.lowered_graph_text()
    Path(args.graph_out).write_text(text)
    print(f"\nlowered graph (also written to {args.graph_out}):\n")
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
