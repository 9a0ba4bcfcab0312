"""Host-side cost of mambac's SSD launchers: our own Python per forward and forward+backward, with
the kernel launches themselves stubbed out (so no GPU is needed and Triton's launcher is left out).

Usage, from the repository root (any machine):

    python benchmarks/ssd_host_overhead.py [--calls N]

Prints a small table: microseconds per call of ``ssd_forward`` and of forward + ``ssd_backward``
at a tiny shape (the launchers' work does not depend on the sizes), every launch planned once
first.  What it leaves out: Triton's own launch path and PyTorch's small ops' kernels.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stub_kernel_launches() -> None:
    """Make the generated kernels' launchers do all their host work but launch nothing: no kernel
    runs, autotuning takes the first candidate untimed, and the candidates are the GPU's."""
    from mambac.codegen import autotune, compile as cc
    cc.CompiledKernel.launch = lambda self, grid, a, constexprs, cfg: None   # no kernel runs
    autotune.choose = lambda family, bucket, cands, bench: cands[0]          # no timing
    autotune.interpreting = lambda: False                                    # the GPU's candidates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    from mambac.codegen import ssd_kernels as fk, ssd_kernels_bwd as bk
    stub_kernel_launches()
    b, l, h, p, n, g, q = 1, 64, 4, 16, 16, 1, 32
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, l, h, p, generator=gen).bfloat16()
    dt = torch.randn(b, l, h, generator=gen).bfloat16()
    A, D, bias = -torch.rand(h, generator=gen), torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    B = torch.randn(b, l, g, n, generator=gen).bfloat16()
    C = torch.randn(b, l, g, n, generator=gen).bfloat16()

    def fwd():
        return fk.ssd_forward(x, dt, A, B, C, D, None, bias, None, q, True, 0.0, math.inf, return_saved=True)

    def fwd_bwd():
        y, _, saved = fwd()
        bk.ssd_backward(y, None, x, dt, A, B, C, D, None, bias, None, q, True, saved=saved)

    fwd_bwd()
    print(f"| SSD launchers, Python only ({args.calls} calls, torch {torch.__version__}) | µs per call |")
    print("|---|---|")
    for name, fn in (("forward", fwd), ("forward + backward", fwd_bwd)):
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        print(f"| {name} | {(time.perf_counter() - t) / args.calls * 1e6:.0f} |")


if __name__ == "__main__":
    main()
