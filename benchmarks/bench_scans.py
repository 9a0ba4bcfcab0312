"""Selective scan (Mamba-1), Mamba-3 SISO and MIMO on the GPU: generated kernels vs the ops' references.

Usage, from the repository root on a CUDA machine:

    PYTHONUNBUFFERED=1 python benchmarks/bench_scans.py [check] [time] [ss] [m3] [mimo] [fp32] [bf16]

check  forward and every input gradient of the generated kernels vs a float64 run of the op's
       reference on the GPU (fp32 and bf16, awkward shapes and a model-sized one)
time   fwd and fwd+bwd medians (``triton.testing.do_bench``) of the generated kernels and of the
       op's plain-PyTorch reference (autograd through it) at model-sized shapes, bf16 inputs
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def import_codegen():
    """mambac.codegen and the two ops from this checkout without mambac/__init__.py."""
    if "mambac" not in sys.modules:
        pkg = types.ModuleType("mambac")
        pkg.__path__ = [str(ROOT / "mambac")]
        sys.modules["mambac"] = pkg
    spec = importlib.util.spec_from_file_location(
        "mambac.codegen", ROOT / "codegen" / "__init__.py", submodule_search_locations=[str(ROOT / "codegen")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mambac.codegen"] = mod
    spec.loader.exec_module(mod)
    sys.modules["mambac"].codegen = mod


import_codegen()
from tests.codegen.scan_cases import (TOL, mamba3_mimo_args, mamba3_siso_args, scan_errors,  # noqa: E402
                                      selective_scan_args)
from mambac.codegen import mamba3_kernels as M3  # noqa: E402
from mambac.codegen import mamba3_mimo_kernels as MM  # noqa: E402
from mambac.codegen import selective_scan_kernels as SS  # noqa: E402
m3op = importlib.import_module("mambac.ops.mamba3_siso")
ssop = importlib.import_module("mambac.ops.selective_scan")
mmop = importlib.import_module("mambac.ops.mamba3_mimo")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ss_inputs = partial(selective_scan_args, device=DEV)
m3_inputs = partial(mamba3_siso_args, device=DEV)
mm_inputs = partial(mamba3_mimo_args, device=DEV)
SS_SHAPES = {"ss-odd": dict(b=2, d=37, l=301, n=13, g=0), "ss-130m": dict(b=2, d=1536, l=2048, n=16, g=0),
             "ss-grouped": dict(b=1, d=1024, l=4096, n=16, g=4)}
M3_SHAPES = {"m3-odd": dict(b=2, l=211, h=5, p=24, n=30, g=1, s=7),
             "m3-model": dict(b=2, l=2048, h=16, p=64, n=64, g=1, s=16)}
MM_SHAPES = {"mimo-odd": dict(b=2, l=133, h=3, p=24, n=30, g=1, s=5, r=2),
             "mimo-model": dict(b=2, l=2048, h=16, p=64, n=64, g=1, s=16, r=4)}


def check_one(name, args, reference, forward, backward, dtype):
    errs = scan_errors(args, reference, forward, backward)
    worst, tol = max(errs.values()), TOL[dtype]
    print(f"check {name:12s} {str(dtype):15s} max rel err {worst:.2e}  "
          f"{'ok' if worst <= tol else 'FAIL'} (tol {tol})", flush=True)


def time_one(name, args, op_forward):
    import triton.testing
    from mambac.ops import use_kernels
    leaves = [a.detach().requires_grad_(True) if isinstance(a, torch.Tensor) else a for a in args]
    row = [name]
    for mode in ("triton", "reference"):
        with use_kernels(mode):
            fwd = lambda: op_forward(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])  # noqa
            outs = op_forward(*leaves)
            gs = [torch.randn_like(o) for o in outs]

            def fb():
                o = op_forward(*leaves)
                torch.autograd.backward(list(o), gs)
            fb()  # compile and autotune outside the timed region
            if DEV == "cuda":
                torch.cuda.synchronize()
            t_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            t_fb = triton.testing.do_bench(fb, warmup=25, rep=100, return_mode="median")
        row += [t_f * 1e3, t_fb * 1e3]
    print(f"| {row[0]} | {row[1]:.0f} | {row[2]:.0f} | {row[3]:.0f} | {row[4]:.0f} | "
          f"{row[3] / row[1]:.1f}x | {row[4] / row[2]:.1f}x |", flush=True)


def main(cmds):
    """``check`` / ``time`` followed by the ops (ss, m3, mimo) and dtypes (fp32, bf16; checks) to
    run; default all."""
    if DEV != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench_scans measures the scan kernels on a CUDA GPU, and this machine has none. On a CPU, "
                         "TRITON_INTERPRET=1 runs them in Triton's interpreter (slowly); the CPU checks are the "
                         "test suite's (tests/codegen).")
    ops = [c for c in cmds if c in ("ss", "m3", "mimo")] or ["ss", "m3", "mimo"]
    dtypes = [d for name, d in (("fp32", torch.float32), ("bf16", torch.bfloat16)) if name in cmds] or [
        torch.float32, torch.bfloat16]
    torch.manual_seed(0)
    print(torch.__version__, torch.cuda.get_device_name() if DEV == "cuda" else "cpu", flush=True)
    if "check" in cmds:
        for dtype in dtypes:
            for name, sh in SS_SHAPES.items() if "ss" in ops else ():
                if name != "ss-grouped" or dtype == torch.bfloat16:
                    check_one(name, ss_inputs(**sh, dtype=dtype), ssop.reference, SS.selective_scan_forward,
                              SS.selective_scan_backward, dtype)
            for name, sh in M3_SHAPES.items() if "m3" in ops else ():
                check_one(name, m3_inputs(**sh, dtype=dtype), m3op.reference, M3.mamba3_siso_forward,
                          M3.mamba3_siso_backward, dtype)
            for name, sh in MM_SHAPES.items() if "mimo" in ops else ():
                if name == "mimo-model" and dtype == torch.float32:
                    continue  # rank 4 compiles slowly; fp32 is checked at mimo-odd
                check_one(name, mm_inputs(**sh, dtype=dtype), mmop.reference, MM.mamba3_mimo_forward,
                          MM.mamba3_mimo_backward, dtype)
    if "time" in cmds:
        print("| shape (bf16) | kernels fwd µs | kernels fwd+bwd µs | reference fwd µs | reference fwd+bwd µs "
              "| fwd speed-up | fwd+bwd speed-up |\n|---|---|---|---|---|---|---|", flush=True)
        for name in ("ss-130m", "ss-grouped") if "ss" in ops else ():
            time_one(name, ss_inputs(**SS_SHAPES[name], dtype=torch.bfloat16), torch.ops.mambac.selective_scan)
        if "m3" in ops:
            time_one("m3-model", m3_inputs(**M3_SHAPES["m3-model"], dtype=torch.bfloat16),
                     torch.ops.mambac.mamba3_siso)
        if "mimo" in ops:
            time_one("mimo-model", mm_inputs(**MM_SHAPES["mimo-model"], dtype=torch.bfloat16),
                     torch.ops.mambac.mamba3_mimo)


if __name__ == "__main__":
    main(sys.argv[1:] or ["check", "time"])
