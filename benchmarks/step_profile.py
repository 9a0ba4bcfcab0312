"""Where a training step's GPU time goes: profiled kernel time by kind, per step.

``profile_steps(step, n)`` runs ``step`` ``n`` times under ``torch.profiler`` (CUDA activity)
and sums the device time of every kernel into a few kinds by kernel name: mambac's generated SSD
kernels (``ssd_*``), its other generated kernels (conv, norms), matrix multiplies (cuBLAS /
CUTLASS / nvjet names), the optimizer's multi-tensor kernels, and the rest (PyTorch elementwise,
reductions, copies).  It also reports the step's wall time, so the gap between the two is the
time the GPU waited on the host (launches, synchronisations).  ``bench_train.py --profile`` uses it.
"""
from __future__ import annotations

import time
from typing import Callable

KINDS = (
    ("SSD (generated)", ("ssd_",)),
    ("conv, norms (generated)", ("causal_conv1d", "rmsnorm", "gated_rmsnorm")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90_", "sm80_", "cublas")),
    ("optimizer", ("multi_tensor", "adam")),
    ("cross-entropy (generated)", ("linear_cross_entropy", "lce_", "cross_entropy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (PyTorch elementwise, reductions, copies)"


def profile_steps(step: Callable[[], object], n: int = 3) -> dict:
    """{'wall_ms': per step, 'kernel_ms': per step, 'kinds': {kind: ms per step}, 'top': [...]}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / n
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None)
        if us is None:
            us = getattr(ev, "cuda_time_total", 0.0)
        if not us or ev.key.startswith("ProfilerStep"):
            continue
        kinds[kind_of(ev.key)] = kinds.get(kind_of(ev.key), 0.0) + us / 1e3 / n
        names[ev.key] = names.get(ev.key, 0.0) + us / 1e3 / n
    top = sorted(names.items(), key=lambda kv: -kv[1])[:12]
    return {"wall_ms": round(wall * 1e3, 2), "kernel_ms": round(sum(kinds.values()), 2),
            "kinds": {k: round(v, 2) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [(k[:80], round(v, 3)) for k, v in top]}


def print_profile(p: dict) -> None:
    print(f"\nper step: wall {p['wall_ms']} ms, GPU kernel time {p['kernel_ms']} ms "
          f"({100 * p['kernel_ms'] / p['wall_ms']:.0f}% busy)")
    print("| kind | ms per step | share of kernel time |")
    print("|---|---|---|")
    for kind, ms in p["kinds"].items():
        print(f"| {kind} | {ms} | {100 * ms / p['kernel_ms']:.1f}% |")
    print("top kernels (ms per step):")
    for name, ms in p["top"]:
        print(f"  {ms:8.3f}  {name}")
