"""End-to-end training of the 130M Mamba-2 LM through ``mambac.compile``: speed, memory, compile time.

Usage, from the repository root:

    python benchmarks/bench_train.py                    # GPU: 130M LM, batch 8 x 2048, modes auto
    python benchmarks/bench_train.py --modes auto,reference --steps 20
    python benchmarks/bench_train.py --tiny --modes reference,triton   # CPU check (tiny LM, interpreter)
    python benchmarks/bench_train.py --cuda-graphs      # GPU: each step replays captured CUDA graphs

The model is ``mamba2-130m`` (d_model 768, 24 layers, vocab 50277 padded to 50288, d_state 128,
headdim 64, expand 2, chunk 256), random weights, fp32 parameters, bf16 autocast on CUDA, AdamW
(fused on CUDA), mean cross-entropy over every token.  For each kernel mode two fresh processes
run: *cold* with empty MAMBAC_CACHE_DIR and TRITON_CACHE_DIR (generated sources, autotune choices
and Triton binaries all made anew) and *warm* with the caches the cold run left (``--once``: the
cold process only).  Each reports the
time from ``mambac.compile`` to the end of the first optimizer step (compile, lower, autotune,
first step), then times ``--steps`` steps after ``--warmup`` more: tokens/s and
``torch.cuda.max_memory_allocated`` (the JSON adds ``max_memory_reserved``).  ``--cuda-graphs``
compiles with ``cuda_graphs=True``: the first step also warms up and captures, and the peak then
leaves out the graphs' private memory pools, which the reserved figure includes.  With $OUT set,
the results are also written there as JSON.  ``--profile`` then profiles three more steps and
prints where their GPU time went (``step_profile.py``: kernel time by kind, and the step's wall
time against it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args: argparse.Namespace) -> dict:
    """One measurement in this process (caches as the environment says)."""
    import torch
    sys.path.insert(0, str(ROOT))
    import mambac
    from mambac.models import MambaConfig, MambaLMHeadModel
    from mambac.presets import preset_config

    cuda = torch.cuda.is_available() and not args.tiny
    dev = "cuda" if cuda else "cpu"
    if args.tiny:
        cfg = MambaConfig(d_model=64, n_layer=2, vocab_size=300, ssm_cfg=dict(
            layer="Mamba2", d_state=16, headdim=16, chunk_size=16))
    else:
        cfg = preset_config("mamba2-130m")
    torch.manual_seed(0)
    model = MambaLMHeadModel(cfg).to(dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seqlen + 1), device=dev, generator=gen)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    lm = mambac.compile(model, kernels=args.mode, cuda_graphs=args.cuda_graphs)
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-4, fused=cuda)

    def step() -> float:
        with autocast:
            loss = lm(inputs, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    first_loss = float(step())
    sync()
    first = time.perf_counter() - t0
    for _ in range(args.warmup):
        step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t1 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    dt = time.perf_counter() - t1
    prof = None
    if args.profile and cuda:
        from step_profile import profile_steps
        prof = profile_steps(step, 3)
    return {"profile": prof, "mode": args.mode, "device": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "triton": _triton_version(), "first_step_s": round(first, 2),
            "tokens_per_s": round(args.batch * args.seqlen * args.steps / dt, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
            "first_loss": round(first_loss, 4), "last_loss": round(float(loss), 4),
            "kernels_loaded": _kernels_loaded(), "cuda_graphs": args.cuda_graphs}


def _kernels_loaded() -> list[str]:
    """Names of the generated kernels this process loaded (empty when only references ran)."""
    mod = sys.modules.get("mambac.codegen.compile")
    return sorted({name for name, _ in getattr(mod, "_LOADED", {})})


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return "-"


def run_child(args: argparse.Namespace, mode: str, caches: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", "--mode", mode, "--batch", str(args.batch),
           "--seqlen", str(args.seqlen), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--cuda-graphs"] if args.cuda_graphs else []
    cmd += ["--profile"] if args.profile else []
    env = dict(os.environ, **caches)
    if args.tiny:  # kernels='triton' then runs the generated kernels in Triton's interpreter
        env["TRITON_INTERPRET"] = "1"
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        print(f"{mode}: no result within {args.child_timeout} s", file=sys.stderr, flush=True)
        return {"mode": mode, "device": "-", "torch": "-", "triton": "-", "first_step_s": f">{args.child_timeout}",
                "tokens_per_s": float("nan"), "peak_gib": None}
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="auto", help="comma-separated kernel modes (auto, triton, reference)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny LM on the CPU (checks the script)")
    ap.add_argument("--once", "--no-cold", dest="no_cold", action="store_true",
                    help="one process only: it starts from empty caches, so it is reported as cold "
                         "(--no-cold, the old name, used to label that process warm)")
    ap.add_argument("--cuda-graphs", action="store_true", help="compile with cuda_graphs=True (GPU only)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU: after the timed steps, profile 3 more and print kernel time by kind (step_profile.py)")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds one measuring process may take")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny and (args.batch, args.seqlen) == (8, 2048):
        args.batch, args.seqlen, args.steps, args.warmup = 2, 32, 3, 1
    if args.child:
        print(json.dumps(child(args)))
        return 0
    import torch
    if not args.tiny and not torch.cuda.is_available():
        raise SystemExit("bench_train times the 130M LM at 8 x 2048 on a CUDA GPU, and this machine has none; "
                         "--tiny runs a tiny LM on the CPU (checks the script).")
    rows = []
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix="mambac-bench-") as tmp:
            caches = {"MAMBAC_CACHE_DIR": f"{tmp}/mambac", "TRITON_CACHE_DIR": f"{tmp}/triton"}
            runs = [("cold", run_child(args, mode, caches))]
            if not args.no_cold:  # a second process on the caches the first one left
                runs.append(("warm", run_child(args, mode, caches)))
        for temp, res in runs:
            rows.append(dict(res, cache=temp))
            print(json.dumps(rows[-1]), flush=True)
    head = next((r for r in rows if r["device"] != "-"), rows[0])
    print(f"\nbatch {args.batch} x seqlen {args.seqlen}, {args.steps} timed steps after {args.warmup} "
          f"(+1 first) on {head['device']}, torch {head['torch']}, triton {head['triton']}"
          + (", CUDA graphs" if args.cuda_graphs else ""))
    print("| kernels | caches | compile + first step s | tokens/s | peak GiB | reserved GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['cache']} | {r['first_step_s']} | {r['tokens_per_s']:,.0f} | {r['peak_gib']} "
              f"| {r.get('reserved_gib')} |")
    for r in rows:
        if r.get("profile"):
            from step_profile import print_profile
            print(f"\n{r['mode']}, {r['cache']} caches:", end="")
            print_profile(r["profile"])
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_train.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
