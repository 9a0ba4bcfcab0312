"""The extra work of context parallelism for SSD, as a fraction of the local scan (one GPU).

At the ANCHORS S1 shape split in 4 (b4, 1024 of the 4096 tokens per rank, h48 p64 n128 g1,
chunk 256, bf16), times what one cp rank runs:

- local scan: the SSD of its piece from a zero state on the generated kernels, keeping the
  forward's intermediates for the backward as the cp form does (``ssd_triton``: what a rank
  would run anyway); the ``mambac::ssd`` op itself, whose backward recomputes the chunk states
  instead of keeping them, is a second baseline row ("local scan, op");
- cp rank r (fold): ``cp_ssd_fused``, the form ``cp_ssd`` runs on generated kernels, for every
  rank of the four: the plain SSD's launches (states from zero by the walk, the chunk scan; the
  reverse walk and the rest of the backward), with the incoming state formed by one small launch
  and taken by the chunk scan as a second dot beside each per-chunk state's on ranks > 0, and the
  later ranks' final-state gradient formed by one small launch and taken by dx and dB as a second
  dot beside each state gradient's (and by dC for the chunks' decay gradients) on ranks < 3, with
  the exchange given (gather: the gathered tensor with this rank's summary in its slot);
- cp rank r (fold, no final state): the same with ``final=False``, what ``split_sequence`` runs
  when nothing reads the op's final state (the LMs): the final state is neither formed nor copied;
- cp, zero-start + correction: the earlier form (``cp_ssd_corrected``: zero-start scan, cumulative
  log-decay, prefix combine, output correction ``y0 + exp(cum) C S_in`` with the z gate), the
  all-gather replaced by the tensor it would return.
The exchange itself is communication, not compute, and is not timed.

Prints forward and forward+backward medians (``triton.testing.do_bench``) and the overhead ratios,
then (CUDA) profiled GPU kernel time.  Usage: ``python benchmarks/bench_cp.py`` on a CUDA machine;
``--tiny`` runs a small case on the CPU with every generated kernel under the Triton interpreter
(plain timers) to check the script; its times mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

if "--tiny" in sys.argv:  # before anything imports Triton: the generated kernels run in its interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch

from mambac.ops import use_kernels
from mambac.runtime import context_parallel as cpf
from mambac.runtime.cp_ssd_fused import Exchange, cp_ssd_fused

S1_SPLIT4 = dict(b=4, l=1024, h=48, p=64, n=128, g=1, q=256, world=4)
TINY = dict(b=1, l=32, h=2, p=8, n=8, g=1, q=16, world=4)


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
    from mambac.codegen.ssd_kernels_bwd import ssd_triton
    if t["x"].is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return ssd_triton(t["x"], t["dt"], t["A"], t["B"], t["C"], q, t["D"], t["z"], t["dt_bias"], None, True)[0]
    return local_op(t, q)


def local_op(t: dict, q: int):
    y, final = torch.ops.mambac.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], None, q,
                                    True, 0.0, float("inf"))
    return y


def exchange_for(rank: int, world: int, gathered: torch.Tensor) -> Exchange:
    """What the all-gathers would return to ``rank``: the other ranks' rows of ``gathered`` (random
    summaries, widened rows for the forward, their first h*p*n entries for the backward's state
    gradients).  The rank's own slot, which NCCL would fill, is left as it is: the form never reads
    it back (copying it in is communication, not compute).  The buffers are made once per (rank,
    world), outside the timed calls."""
    key = (rank, world, id(gathered))
    if key in _EXCHANGES:
        return _EXCHANGES[key]
    bufs: dict[int, torch.Tensor] = {}

    def gather(mine: torch.Tensor) -> torch.Tensor:
        k = mine.shape[1]
        if k not in bufs:
            bufs[k] = gathered[:world, :, :k].clone()
        return bufs[k]   # this rank's own slot is never read back, so it is not copied in
    _EXCHANGES[key] = Exchange(gather=gather, rank=rank)
    return _EXCHANGES[key]


_EXCHANGES: dict[tuple, Exchange] = {}


def cp_rank(t: dict, q: int, world: int, gathered: torch.Tensor, rank: int | None = None, final: bool = True):
    """Cp rank ``rank`` (default: the last) running ``cp_ssd`` on generated kernels, the
    exchange's results given; ``final`` False: without the final state (as ``split_sequence``
    runs it when nothing reads the state, e.g. the LMs)."""
    ex = exchange_for(world - 1 if rank is None else rank, world, gathered)
    return cp_ssd_fused(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], q, True, 0.0,
                        float("inf"), ex, final)


def cp_rank_corrected(t: dict, q: int, world: int, gathered: torch.Tensor):
    """The last cp rank's zero-start + correction body, the exchange's result given."""
    ct = torch.float32
    y0, local = torch.ops.mambac.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], None, t["dt_bias"], None, q,
                                     True, 0.0, float("inf"))
    cum = cpf.ssd_summaries(t["dt"], t["A"], t["dt_bias"], True, 0.0, float("inf"), ct)
    log_decay = cum[:, -1]
    mine = cpf.pack_summaries(local.to(ct), log_decay)
    every = torch.cat([gathered[:-1], mine.unsqueeze(0)], 0)   # what the all-gather returns
    states, decays = cpf.unpack_summaries(every, (local, log_decay))
    s_in = cpf.incoming_state(states, decays, world - 1)
    y = cpf.ssd_correction(y0, t["C"], cum, s_in, t["z"])
    final = local.to(ct) + torch.exp(log_decay)[..., None, None] * s_in
    return y, final


def _rank_form(rank: int, final: bool):
    return lambda t, q, world, gathered: cp_rank(t, q, world, gathered, rank, final)


KEPT, DROPPED = "(fold)", "(fold, no final state)"
FORMS = (("local scan", None), ("local scan, op", lambda t, q, world, gathered: local_op(t, q))) + tuple(
    (f"cp rank {r} of 4 {KEPT}", _rank_form(r, True)) for r in range(4)) + tuple(
    (f"cp rank {r} of 4 {DROPPED}", _rank_form(r, False)) for r in range(4)) + (
    ("cp rank 3 of 4, zero-start + correction", cp_rank_corrected),)


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


def timer(device: str):
    if device == "cuda":
        import triton.testing
        return lambda fn: triton.testing.do_bench(fn, warmup=30, rep=200) * 1e3   # µs

    def cpu(fn):   # the tiny run checks the script: one timed call after one warm-up (its times mean nothing)
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return cpu


def _bodies(t: dict, s: dict, gathered: torch.Tensor) -> dict:
    """Each timed form as a no-argument call."""
    q, w = s["q"], s["world"]
    return {name: (lambda: local_scan(t, q)) if fn is None else (lambda fn=fn: fn(t, q, w, gathered))
            for name, fn in FORMS}


def _forward_pieces(t: dict, s: dict, gathered: torch.Tensor, bench) -> dict:
    """Time of the cp rank's own small launches (what the fold form adds besides the folds inside
    the chunk scan, dx and dB), and of the zero-start + correction form's pieces."""
    from mambac.codegen.cp_combine_kernels import incoming_state, outgoing_gradient
    from mambac.codegen.ssd_kernels import forward_path, prepare, run_states
    from mambac.runtime.cp_ssd_fused import chunk_totals
    ct, inf = torch.float32, float("inf")
    pr = prepare(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], None, s["q"], True, 0.0, inf)
    d, io = pr.dims, pr.region.torch_io
    _, f_local, _, cs = run_states(pr, forward_path(pr))
    last, hpn = s["world"] - 1, s["h"] * s["p"] * s["n"]
    totals = gathered[..., hpn:].contiguous()
    y0, local = torch.ops.mambac.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], None, t["dt_bias"],
                                     None, s["q"], True, 0.0, inf)
    cum = cpf.ssd_summaries(t["dt"], t["A"], t["dt_bias"], True, 0.0, inf, ct)
    s_in = cpf.incoming_state(*cpf.unpack_summaries(gathered, (f_local, totals[0])), last)
    return {
        "incoming state (rank 3)": bench(lambda: incoming_state(gathered, last, cs, f_local, d.q, io)),
        "outgoing gradient (rank 0)": bench(lambda: outgoing_gradient(gathered[..., :hpn], totals, 0, cs,
                                                                       tuple(f_local.shape), d.q, io)),
        "total decay from cs (per-chunk path only: the walk writes it)": bench(lambda: chunk_totals(pr, cs).sum(-1)),
        "old: summaries (cumulative log-decay)": bench(lambda: cpf.ssd_summaries(
            t["dt"], t["A"], t["dt_bias"], True, 0.0, inf, ct)),
        "old: correction (+ z gate)": bench(lambda: cpf.ssd_correction(y0, t["C"], cum, s_in, t["z"])),
    }


def _check(t: dict, s: dict, gathered: torch.Tensor) -> float:
    """Rank 0 of a 1-rank split (nothing comes in) must reproduce the plain scan."""
    y_ref = local_scan(t, s["q"])
    y_cp, _ = cp_rank(t, s["q"], 1, gathered)
    return ((y_cp.float() - y_ref.float()).norm() / y_ref.float().norm()).item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tiny", action="store_true", help="small case on the CPU (checks the script)")
    ap.add_argument("--ops", action="store_true", help="print the profiler's op table of each GPU-timed body")
    args = ap.parse_args(argv)
    global _OPS_TABLE
    _OPS_TABLE = args.ops
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("the CPU run needs the Triton interpreter: pass --tiny (it sets TRITON_INTERPRET=1)")
    s = TINY if device == "cpu" else S1_SPLIT4
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    t = inputs(s, device, dtype)
    per_rank = (s["b"], s["h"] * s["p"] * s["n"] + s["h"])
    gathered = torch.randn(s["world"], *per_rank, device=device) * 0.1
    dy = torch.randn(s["b"], s["l"], s["h"], s["p"], device=device, dtype=dtype)
    bench = timer(device)
    params = list(t.values())

    def fwd_bwd(fn):
        def run():
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, params, dy, allow_unused=True)
        return run

    with use_kernels("triton" if device == "cpu" else "auto"):
        err = _check(t, s, gathered)
        bodies = _bodies(t, s, gathered)
        rows = {}
        with torch.no_grad():
            rows["fwd"] = {k: bench(fn) for k, fn in bodies.items()}
        rows["fwd+bwd"] = {k: bench(fwd_bwd(fn)) for k, fn in bodies.items()}
        with torch.no_grad():
            parts = _forward_pieces(t, s, gathered, bench)
        graphed, kernels = {}, {}
        if device == "cuda":  # the GPU's own work, without Python's launch cost: profiled kernel time
            for key, fn in bodies.items():
                for kind, body in (("fwd", fn), ("fwd+bwd", fwd_bwd(fn))):
                    with torch.no_grad() if kind == "fwd" else contextlib.nullcontext():
                        graphed[kind, key], kernels[kind, key] = gpu_time(body)
    _report(device, dtype, err, rows, parts, graphed, kernels)
    return 0


def _report(device, dtype, err, rows, parts, graphed, kernels) -> None:
    name = "S1 split in 4 (b4 l1024 h48 p64 n128 g1)" if device == "cuda" else "tiny (CPU, Triton interpreter)"
    print(f"context-parallel SSD overhead, {name}, {dtype}, device "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}")
    print(f"check: zero incoming state reproduces the scan, rel err {err:.1e}")
    print("| pass | form | local scan µs | cp rank µs | extra µs | extra / local scan |")
    print("|---|---|---|---|---|---|")
    for kind, times in rows.items():
        base = times["local scan"]
        for form, cp in times.items():
            if form != "local scan":
                print(f"| {kind} | {form} | {base:.1f} | {cp:.1f} | {cp - base:.1f} | {100 * (cp - base) / base:.1f}% |")
    print("forward pieces of the cp rank (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    for kind in ("fwd", "fwd+bwd"):
        if (kind, "local scan") not in graphed:
            continue
        base = graphed[kind, "local scan"]
        for form, _ in FORMS[1:]:
            cp = graphed[kind, form]
            print(f"{kind}, GPU kernel time only (µs), {form}: local scan {base:.1f}, cp rank {cp:.1f}, "
                  f"extra {cp - base:.1f} µs, {100 * (cp - base) / base:.1f}%")
            local = kernels[kind, "local scan"]   # a fold or part form's kernel against the plain one it replaces
            extra = {k: v - local.get(k, local.get(k.replace("_fold", "").replace("_part", ""), 0.0))
                     for k, v in kernels[kind, form].items()}
            top = sorted(((v, k) for k, v in extra.items() if v > 0.5), reverse=True)[:8]
            print("  kernels it adds (µs per call): " + "; ".join(f"{k[:60]} {v:.1f}" for v, k in top))
    for variant in (KEPT, DROPPED):
        ranks = [f for f, _ in FORMS if f.startswith("cp rank") and f.endswith(variant)]
        for kind in ("fwd", "fwd+bwd"):
            if (kind, "local scan") not in graphed:
                continue
            worst = max(ranks, key=lambda f: graphed[kind, f])
            for base_name in ("local scan", "local scan, op"):
                base = graphed[kind, base_name]
                extra = graphed[kind, worst] - base
                print(f"summary, {kind}, GPU kernel time: worst rank ({worst}) extra {extra:.1f} µs = "
                      f"{100 * extra / base:.1f}% of '{base_name}' ({base:.1f} µs)")


if __name__ == "__main__":
    raise SystemExit(main())
