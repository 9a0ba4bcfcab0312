"""The main job (``make demo``): train a small Mamba-2 LM compiled by mambac over ``--world-size``
ranks (4 by default: tensor-parallel over 2 x context-parallel over 2, each rank holding half of
the heads of half of every sequence), on two tasks from the Mamba paper — selective copying and
induction heads — generated on the fly; then check the trained compiled model against eager and
write the lowered graph of rank 0 to a file.

Without a process group the demo launches its own ranks through ``torch.distributed.run``: on a
machine with at least one GPU per rank, one GPU per rank and NCCL; otherwise the CPU and gloo
(``--device cpu|cuda`` chooses).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import mambac
from mambac.cli_types import count, rate, seconds
from mambac.models import MambaConfig, MambaLMHeadModel
from mambac.tasks import TASK_VOCAB, accuracy, mixed_batch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def build_model(device: str, seed: int = 0) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    cfg = MambaConfig(d_model=64, n_layer=2, vocab_size=TASK_VOCAB, pad_vocab_size_multiple=8,
                      ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=16))
    return MambaLMHeadModel(cfg, device=device)


def next_token_batch(batch: int, gen: torch.Generator, device: str):
    """Inputs and shifted targets; only the scored positions of each task keep a target."""
    ids, labels = mixed_batch(batch, gen)
    inp, tgt = ids[:, :-1], ids[:, 1:].clone()
    tgt[labels[:, :-1] == -100] = -100
    return inp.to(device), tgt.to(device)


def train(compiled: torch.nn.Module, steps: int, batch: int, lr: float, device: str, seed: int = 1,
          show: bool = True) -> float:
    """AdamW with a one-cycle schedule; returns the final held-out accuracy."""
    from tqdm import tqdm

    opt = torch.optim.AdamW(compiled.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen, held = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1000)
    eval_inp, eval_tgt = next_token_batch(256, held, device)
    acc = 0.0
    bar = tqdm(range(steps), desc="training", unit="step", dynamic_ncols=True, disable=not show)
    for step in bar:
        inp, tgt = next_token_batch(batch, gen, device)
        loss = compiled(inp, tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 25 == 0 or step == steps - 1:
            with torch.no_grad():
                acc = accuracy(compiled(eval_inp), eval_tgt)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.1%}")
    return acc


def parity(compiled: torch.nn.Module, device: str) -> tuple[float, float, float]:
    """Compiled (trained, possibly sharded) vs an eager copy holding its unsharded weights: relative
    errors of the logits, the loss, and the global gradient norm."""
    eager = build_model(device)
    eager.load_state_dict(compiled.state_dict())
    inp, tgt = next_token_batch(8, torch.Generator().manual_seed(7), device)
    with torch.no_grad():
        logit_err = _rel(compiled(inp), eager(inp))
    loss_c, loss_e = compiled(inp, tgt), eager(inp, tgt)
    compiled.zero_grad(set_to_none=True)
    loss_c.backward()
    loss_e.backward()
    norm_c = mambac.clip_grad_norm_(compiled, float("inf"))
    norm_e = torch.nn.utils.clip_grad_norm_(eager.parameters(), float("inf"))
    return logit_err, _rel(loss_c.detach(), loss_e.detach()), _rel(norm_c, norm_e)


def _launched_here(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Start the ranks when asked for several and none are running yet; None inside a rank."""
    if args.world_size == 1 or "RANK" in os.environ:
        return None
    from mambac.runtime.launcher import launch

    tp, cp = layout(args)
    print(f"launching {args.world_size} ranks (tp={tp} x cp={cp}) through torch.distributed.run")
    return launch(args.world_size, __file__, argv, timeout=args.timeout)


def layout(args: argparse.Namespace) -> tuple[int, int]:
    """(tp, cp) for the demo's world size."""
    cp = args.cp if args.cp is not None else (2 if args.world_size % 2 == 0 else 1)
    if cp < 1 or args.world_size % cp:
        raise SystemExit(f"--cp {cp} does not divide --world-size {args.world_size}")
    return args.world_size // cp, cp


def _without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without ``name VALUE`` / ``name=VALUE``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def pick_device(choice: str, world_size: int) -> str:
    """``auto``: CUDA where every rank gets a GPU of its own (NCCL needs one per rank), else the CPU."""
    if choice != "auto":
        return choice
    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "cpu"


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="mambac demo", description=__doc__)
    ap.add_argument("--steps", type=count, default=250)
    ap.add_argument("--batch", type=count, default=64)
    ap.add_argument("--lr", type=rate, default=3e-3)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto (default): cuda with NCCL where there is a GPU for every rank, else cpu with gloo")
    ap.add_argument("--world-size", type=count, default=4, help="ranks (1: no process group)")
    ap.add_argument("--cp", type=count, default=None,
                    help="context-parallel ranks (default: 2 when world_size is even, else 1); tp = world_size / cp")
    ap.add_argument("--timeout", type=seconds, default=1800, help="stop every rank after this many seconds")
    ap.add_argument("--graph-out", default="mambac_demo_graph.txt", help="file the lowered graph is written to")
    args = ap.parse_args(argv)
    args.device = pick_device(args.device, args.world_size)
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--device cuda needs a GPU for each of the {args.world_size} ranks; this machine has "
                         f"{torch.cuda.device_count()}. Pass --world-size {max(torch.cuda.device_count(), 1)} "
                         "or --device cpu.")
    argv = _without_option(argv, "--device") + ["--device", args.device]  # the ranks get the choice made here
    launched = _launched_here(args, argv)
    if launched is not None:
        return launched
    return run_rank(args)


def run_rank(args: argparse.Namespace) -> int:
    """One rank's job (the only one when world_size is 1)."""
    rank = int(os.environ.get("RANK", 0))
    device = args.device
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    t_start = time.perf_counter()
    model = build_model(device)
    n_params = sum(p.numel() for p in model.parameters())
    tp, cp = layout(args)
    say(f"model: Mamba-2 LM, {model.config.n_layer} layers, d_model {model.config.d_model}, "
        f"{n_params / 1e3:.0f}k parameters, on {args.device}, world_size {args.world_size} (tp={tp} x cp={cp})")
    example = next_token_batch(2, torch.Generator().manual_seed(0), device)
    opts = dict(tp=tp, cp=cp) if args.world_size > 1 else {}
    compiled = mambac.compile(model, world_size=args.world_size, example_inputs=example, **opts)
    program = compiled.program_for(*example)
    for name, stats in program.ctx.stats.items():
        say(f"  pass {name:22s} {program.ctx.timings.get(name, 0) * 1e3:7.1f} ms  {stats.counts}")
    say("tasks: selective copying + induction heads (Mamba paper), generated on the fly")
    acc = train(compiled, args.steps, args.batch, args.lr, device, show=rank == 0)
    logit_err, loss_err, norm_err = parity(compiled, device)
    ok = max(logit_err, loss_err, norm_err) <= 1e-5
    say(f"held-out accuracy {acc:.1%}")
    say(f"parity vs eager (trained weights): logits rel err {logit_err:.1e}, loss {loss_err:.1e}, "
        f"global grad norm {norm_err:.1e} -> {'OK' if ok else 'MISMATCH'}")
    if rank == 0:
        Path(args.graph_out).write_text(compiled.lowered_graph_text())
    say(f"lowered graph of rank 0 written to {args.graph_out}; total {time.perf_counter() - t_start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
