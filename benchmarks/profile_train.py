"""Where a training step of the compiled 130M Mamba-2 LM spends its time (one GPU, torch.profiler).

    python benchmarks/profile_train.py [--batch 8 --seqlen 2048 --steps 2] [--tiny]

Prints the step's wall time, the GPU's busy time (sum of kernel times) and the kernels grouped by
name, most expensive first, with their share of the GPU time: what to make faster next.  ``--tiny``
runs a tiny LM on the CPU (CPU op times instead of kernel times) to check the script.
"""
from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch

import mambac
from mambac.models import MambaLMHeadModel
from mambac.presets import preset_config


def group_name(key: str) -> str:
    """Kernels grouped by what they are (Triton kernels by name, library GEMMs together)."""
    k = key.lower()
    if "gemm" in k or "cutlass" in k or "sm90_xmma" in k or "nvjet" in k:
        return "matmul (cuBLAS)"
    if "elementwise" in k or "vectorized" in k or "unrolled" in k:
        what = re.findall(r"(?:native::|<)(\w*(?:Functor|_kernel|Op)\w*)", key)
        return "elementwise (PyTorch): " + (what[0] if what else "?")[:40]
    if "reduce" in k:
        return "reductions (PyTorch)"
    return re.sub(r"_\d+$", "", key)[:70]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--by-op", action="store_true",
                    help="group kernel time by the chain of ops that launched it (with input shapes)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        raise SystemExit("profile_train profiles the 130M LM's step on a CUDA GPU, and this machine has none; "
                         "--tiny profiles a tiny LM on the CPU.")
    device = "cuda" if cuda else "cpu"
    name = "mamba2-tiny" if args.tiny else "mamba2-130m"
    batch, seqlen = (2, 64) if args.tiny else (args.batch, args.seqlen)
    torch.manual_seed(0)
    model = MambaLMHeadModel(preset_config(name), device=device)
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (batch, seqlen), device=device)
    compiled = mambac.compile(model, example_inputs=(ids, ids))
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4, fused=cuda)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = compiled(ids, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    if cuda:
        torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts, record_shapes=args.by_op) as prof:
        for _ in range(args.steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    if args.by_op:
        return print_by_op(prof, args.steps, args.top, cuda)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.key_averages():
        if cuda and ev.device_type.name != "CUDA":
            continue
        t = (ev.device_time_total if cuda else ev.self_cpu_time_total) / args.steps
        if t <= 0:
            continue
        g = groups[group_name(ev.key) if cuda else ev.key]
        g[0] += t
        g[1] += ev.count // args.steps
    busy = sum(t for t, _ in groups.values())
    print(f"{name}, batch {batch} x {seqlen}, {'bf16 autocast on ' + torch.cuda.get_device_name() if cuda else 'cpu'}")
    print(f"step wall {wall * 1e3:.1f} ms, {'GPU busy' if cuda else 'CPU op time'} {busy / 1e3:.1f} ms "
          f"({100 * busy / 1e3 / (wall * 1e3):.0f}% of the wall time), {batch * seqlen / wall:,.0f} tokens/s")
    print("| kernels | calls/step | ms/step | share |")
    print("|---|---|---|---|")
    for key, (t, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"| {key} | {n} | {t / 1e3:.2f} | {100 * t / busy:.1f}% |")
    return 0


def op_chain(ev, depth: int = 4) -> str:
    """The op that launched a kernel (with its input shapes) and up to ``depth`` callers."""
    names = [f"{ev.name}{list(ev.input_shapes)[:3] if ev.input_shapes else ''}"]
    parent = ev.cpu_parent
    while parent is not None and len(names) <= depth:
        names.append(parent.name)
        parent = parent.cpu_parent
    return " < ".join(names)


def print_by_op(prof, steps: int, top: int, cuda: bool) -> int:
    """Kernel time per launching op chain: which ops of the program the copies and cats come from."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        kernels = getattr(ev, "kernels", None) or []
        t = sum(k.duration for k in kernels) if cuda else ev.self_cpu_time_total
        if t <= 0 or (not cuda and ev.cpu_children):
            continue
        g = groups[op_chain(ev)]
        g[0] += t / steps
        g[1] += 1
    total = sum(t for t, _ in groups.values())
    print(f"time by launching op chain, {total / 1e3:.1f} ms per step")
    print("| op < callers | calls/step | ms/step | share |")
    print("|---|---|---|---|")
    for key, (t, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {key[:160]} | {n // steps} | {t / 1e3:.3f} | {100 * t / total:.1f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
