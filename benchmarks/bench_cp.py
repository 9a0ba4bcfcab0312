"""The extra work of context parallelism for SSD, as a fraction of the local scan (one GPU).

At the ANCHORS S1 shape split in 4 (b4, 1024 of the 4096 tokens per rank, h48 p64 n128 g1,
chunk 256, bf16), times what one cp rank runs:

- local scan: ``mambac::ssd`` on its piece from a zero state (what a rank would run anyway);
- cp: the same scan, plus the summaries (cumulative log-decay), the prefix combine of every rank's
  (final state, decay) summary and the output correction ``y0 + exp(cum) C S_in`` with the z gate,
  i.e. the body of ``mambac.runtime.context_parallel.cp_ssd`` for the last rank (the one with the
  most to combine), with the all-gather replaced by the gathered tensor it would return (the
  exchange itself is communication, not compute, and is not timed).

Prints forward and forward+backward medians (``triton.testing.do_bench``) and the overhead ratio.
Usage: ``python benchmarks/bench_cp.py`` on a CUDA machine; ``--tiny`` runs a small case on the CPU
(reference ops, plain timers) to check the script.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

from mambac.ops import use_kernels
from mambac.runtime import context_parallel as cpf

S1_SPLIT4 = dict(b=4, l=1024, h=48, p=64, n=128, g=1, q=256, world=4)
TINY = dict(b=1, l=64, h=4, p=8, n=8, g=1, q=16, world=4)


def inputs(s: dict, device: str, dtype: torch.dtype) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device, dtype).requires_grad_()

    b, l, h, p, n, gr = s["b"], s["l"], s["h"], s["p"], s["n"], s["g"]
    return dict(x=r(b, l, h, p), dt=r(b, l, h, scale=0.5), B=r(b, l, gr, n), C=r(b, l, gr, n), z=r(b, l, h, p),
                A=(-torch.rand(h, generator=g) - 0.5).to(device).requires_grad_(),
                D=torch.randn(h, generator=g).to(device).requires_grad_(),
                dt_bias=torch.randn(h, generator=g).to(device).requires_grad_())


def local_scan(t: dict, q: int):
    y, final = torch.ops.mambac.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], None, q,
                                    True, 0.0, float("inf"))
    return y


def cp_rank(t: dict, q: int, world: int, gathered: torch.Tensor):
    """The last cp rank's ``cp_ssd`` body, the exchange's result given."""
    ct = torch.float32
    y0, local = torch.ops.mambac.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], None, t["dt_bias"], None, q,
                                     True, 0.0, float("inf"))
    cum = cpf.ssd_summaries(t["dt"], t["A"], t["dt_bias"], True, 0.0, float("inf"), ct)
    log_decay = cum[:, -1]
    mine = cpf._pack(local.to(ct), log_decay)
    every = torch.cat([gathered[:-1], mine.unsqueeze(0)], 0)   # what the all-gather returns
    states, decays = cpf._unpack(every, (local, log_decay))
    s_in = cpf.incoming_state(states, decays, world - 1)
    y = cpf.ssd_correction(y0, t["C"], cum, s_in, t["z"])
    final = local.to(ct) + torch.exp(log_decay)[..., None, None] * s_in
    return y, final


_OPS_TABLE = False   # --ops: print the profiler's table of ops per timed body


def gpu_time(fn, reps: int = 20) -> tuple[float, dict[str, float]]:
    """Mean GPU time of one call of ``fn`` (µs): the summed durations of the kernels (and copies)
    the profiler records, so launch gaps do not count; also the time per kernel name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / reps
    if _OPS_TABLE:
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14))
    return sum(per_name.values()), per_name


def _reference(fn):
    """``fn`` with the generated kernels off (the PyTorch forms)."""
    def run():
        with use_kernels("reference"):
            return fn()
    return run


def timer(device: str):
    if device == "cuda":
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=30, rep=200) * 1e3   # µs

    def cpu(fn, reps: int = 5):
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    return cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="small case on the CPU (checks the script)")
    ap.add_argument("--ops", action="store_true", help="print the profiler's op table of each GPU-timed body")
    args = ap.parse_args(argv)
    global _OPS_TABLE
    _OPS_TABLE = args.ops
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    s = TINY if device == "cpu" else S1_SPLIT4
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    t = inputs(s, device, dtype)
    per_rank = (s["b"], s["h"] * s["p"] * s["n"] + s["h"])
    gathered = torch.randn(s["world"], *per_rank, device=device) * 0.1
    dy = torch.randn(s["b"], s["l"], s["h"], s["p"], device=device, dtype=dtype)
    bench = timer(device)
    rows = {}
    with use_kernels("auto"):
        # correctness of the timed body: rank 0 of a 1-rank split equals the plain scan
        y_ref = local_scan(t, s["q"])
        y_cp, _ = cp_rank(t, s["q"], 1, gathered[:0])
        err = ((y_cp.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        params = [v for v in t.values()]

        def fwd_bwd(fn):
            def run():
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                torch.autograd.grad(out, params, dy, allow_unused=True)
            return run

        with torch.no_grad():
            rows["fwd"] = (bench(lambda: local_scan(t, s["q"])), bench(lambda: cp_rank(t, s["q"], s["world"], gathered)))
        rows["fwd+bwd"] = (bench(fwd_bwd(lambda: local_scan(t, s["q"]))),
                           bench(fwd_bwd(lambda: cp_rank(t, s["q"], s["world"], gathered))))
        with torch.no_grad():  # forward time of each piece of the cp rank's extra work
            ct = torch.float32
            y0, local = torch.ops.mambac.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], None, t["dt_bias"],
                                             None, s["q"], True, 0.0, float("inf"))
            cum = cpf.ssd_summaries(t["dt"], t["A"], t["dt_bias"], True, 0.0, float("inf"), ct)
            states, decays = cpf._unpack(gathered, (local, cum[:, -1]))
            s_in = cpf.incoming_state(states, decays, s["world"] - 1)
            parts = {
                "scan without z": bench(lambda: torch.ops.mambac.ssd(
                    t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], None, t["dt_bias"], None, s["q"], True, 0.0,
                    float("inf"))),
                "summaries (cumulative log-decay)": bench(lambda: cpf.ssd_summaries(
                    t["dt"], t["A"], t["dt_bias"], True, 0.0, float("inf"), ct)),
                "summaries, PyTorch form": bench(_reference(lambda: cpf.ssd_summaries(
                    t["dt"], t["A"], t["dt_bias"], True, 0.0, float("inf"), ct))),
                "prefix combine": bench(lambda: cpf.incoming_state(states, decays, s["world"] - 1)),
                "correction (+ z gate)": bench(lambda: cpf.ssd_correction(y0, t["C"], cum, s_in, t["z"])),
            }
        graphed = {}
        kernels = {}
        if device == "cuda":  # the GPU's own work, without Python's launch cost: profiled kernel time
            for key, fn in (("local scan", lambda: local_scan(t, s["q"])),
                            ("cp rank", lambda: cp_rank(t, s["q"], s["world"], gathered))):
                for kind, body in (("fwd", fn), ("fwd+bwd", fwd_bwd(fn))):
                    with torch.no_grad() if kind == "fwd" else contextlib.nullcontext():
                        graphed[kind, key], kernels[kind, key] = gpu_time(body)
    name = "S1 split in 4 (b4 l1024 h48 p64 n128 g1)" if device == "cuda" else "tiny (CPU)"
    print(f"context-parallel SSD overhead, {name}, {dtype}, device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"check: zero incoming state reproduces the scan, rel err {err:.1e}")
    print(f"| pass | local scan µs | cp rank µs | extra µs | extra / local scan |")
    print(f"|---|---|---|---|---|")
    for k, (base, cp) in rows.items():
        print(f"| {k} | {base:.1f} | {cp:.1f} | {cp - base:.1f} | {100 * (cp - base) / base:.1f}% |")
    print("forward pieces of the cp rank (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    for kind in ("fwd", "fwd+bwd"):
        if (kind, "local scan") not in graphed:
            continue
        base, cp = graphed[kind, "local scan"], graphed[kind, "cp rank"]
        extra = f"{cp - base:.1f} µs, {100 * (cp - base) / base:.1f}%" if isinstance(cp, float) and \
            isinstance(base, float) else "-"
        print(f"{kind}, GPU kernel time only (µs): local scan {base:.1f}, cp rank {cp:.1f}, extra {extra}")
        extra_kernels = {k: v - kernels[kind, "local scan"].get(k, 0.0) for k, v in kernels[kind, "cp rank"].items()}
        top = sorted(((v, k) for k, v in extra_kernels.items() if v > 0.5), reverse=True)[:8]
        print(f"  kernels the cp rank adds ({kind}, µs per call): " + "; ".join(f"{k[:60]} {v:.1f}" for v, k in top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
