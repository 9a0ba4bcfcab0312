"""SSD (Mamba-2 chunked scan) on the GPU: mambac's generated kernels next to mamba_ssm, one run.

Usage, from the repository root on a CUDA machine:

    PYTHONUNBUFFERED=1 python benchmarks/bench_ssd.py [COMMAND ...]

Commands (default: check time parts):
  check       forward and every input gradient vs the float64 reference (``mambac.ops.ssd``) on
              the GPU at S1 and S2 (bf16)
  check-odd   the same at awkward shapes: odd lengths, headdim/dstate not powers of two, z, D per
              (head, headdim), initial state, dt clamp
  check-fp32  an fp32 case (ieee matmuls)
  time        fwd and fwd+bwd medians (``triton.testing.do_bench``) at the ANCHORS shapes S1 and
              S2, for mambac and for mamba_ssm's ``mamba_chunk_scan_combined`` (source in
              ``.bench_deps/mamba_ssm``; see the shared ANCHORS page)
  graphed     with ``time``: fwd+bwd also replayed from a CUDA graph, which leaves out the host's
              launch cost (a failed capture can leave the CUDA context unusable for the rest of the process)
  parts       time of each generated kernel alone at S1 (parts-s2: at S2)
  variants    the kernels of VARIANTS alone at S1 and S2 with each of their tiles there (outside
              the candidate lists, e.g. with a register cap), and each result's difference from
              the default tile's
  host        the host's cost of the ungraphed S1 fwd+bwd: wall time per call with the calls queued
              back to back, through Triton's launch path and through direct launches
              (``codegen/direct_launch.py``), and a cProfile of the direct one's top functions
  streams     fwd, and fwd+bwd (replayed from a CUDA graph, and launched from Python) with the
              independent launches on a second stream (codegen/streams.py) and on one,
              alternated, at S1 and S2; the tiles are PINNED (autotune's choices of the sixth
              round's runs), so nothing is timed twice
  chunks      mambac's fwd and fwd+bwd (from CUDA graphs) at S1 and S2 computed with chunks of 256,
              128 and 64 steps (the same function; the chunk length trades the quadratic
              intra-chunk work against the states' traffic), and the S1 check at each
  warm K I [Q,...]  compile (without timing) the I-th of K slices of the autotune candidates at S1 and
              S2 (with chunks of Q steps, default 256), so that K processes can fill Triton's compile cache in parallel first
Checks run with the first tile candidate (no autotune).  With $OUT set, the full results are also written there as JSON.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import traceback
import types
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RES: dict = {}
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRAPHED = False  # set by the "graphed" command
S1 = dict(b=4, l=4096, h=48, p=64, n=128, g=1, q=256)
S2 = dict(b=1, l=16384, h=64, p=64, n=128, g=8, q=256)
ANCHOR_US = {("S1", "fwd"): 627, ("S1", "fwd+bwd"): 5355, ("S2", "fwd"): 873, ("S2", "fwd+bwd"): 6392}


def rec(key: str, value) -> None:
    RES[key] = value
    print(f"{key:64s} {value}", flush=True)


def import_codegen():
    """mambac.codegen from this checkout, without running mambac/__init__.py: the benchmark
    needs only the kernels and the op reference, not the compiler front end (nor its imports)."""
    if "mambac" not in sys.modules:
        pkg = types.ModuleType("mambac")
        pkg.__path__ = [str(ROOT / "mambac")]
        sys.modules["mambac"] = pkg
    spec = importlib.util.spec_from_file_location(
        "mambac.codegen", ROOT / "codegen" / "__init__.py",
        submodule_search_locations=[str(ROOT / "codegen")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["mambac.codegen"] = mod
    spec.loader.exec_module(mod)
    sys.modules["mambac"].codegen = mod
    return mod


def import_mamba_ssm():
    """mamba_ssm's combined SSD op from .bench_deps, skipping its package __init__ (which
    imports CUDA extensions that are not built here)."""
    deps = ROOT / ".bench_deps"
    if not (deps / "mamba_ssm").is_dir():
        return None
    sys.path.insert(0, str(deps))
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = [str(deps / "mamba_ssm")]
    sys.modules.setdefault("mamba_ssm", pkg)
    try:
        return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    except Exception as exc:  # noqa: BLE001 -- reported in one line; the run goes on without the anchor
        print(f"mamba_ssm from .bench_deps does not import ({type(exc).__name__}: {exc}); timing mambac alone",
              file=sys.stderr)
        return None


def bench_ms(fn) -> float:
    import triton.testing as tt
    return tt.do_bench(fn, warmup=30, rep=200, return_mode="median")


def graphed_ms(fn) -> float:
    """Median time of ``fn`` replayed from a CUDA graph: its GPU time without the host's launch
    cost (warmed up on a side stream first, as graph capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def inputs(b, l, h, p, n, g, dtype=torch.bfloat16, seed=0, z=False, d_dim=False, init=False):
    """The anchors' input recipe (bf16 x/dt/B/C; fp32 A, D, dt_bias), plus optional extras."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(b, l, h, p, device=DEV, dtype=dtype, generator=gen)
    dt = torch.randn(b, l, h, device=DEV, dtype=dtype, generator=gen) * 0.5 - 2.0
    A = -torch.rand(h, device=DEV, dtype=torch.float32, generator=gen) * 8 - 1
    B = torch.randn(b, l, g, n, device=DEV, dtype=dtype, generator=gen)
    C = torch.randn(b, l, g, n, device=DEV, dtype=dtype, generator=gen)
    D = torch.randn(*((h, p) if d_dim else (h,)), device=DEV, dtype=torch.float32, generator=gen)
    dtb = torch.randn(h, device=DEV, dtype=torch.float32, generator=gen) * 0.1
    zt = torch.randn(b, l, h, p, device=DEV, dtype=dtype, generator=gen) if z else None
    it = torch.randn(b, h, p, n, device=DEV, dtype=torch.float32, generator=gen) if init else None
    return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=zt, dt_bias=dtb, initial_state=it)


NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_state")


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("nan")
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check_case(cg, tag, shape, dtype=torch.bfloat16, limit=(0.0, math.inf), **extra):
    """Forward and gradients of ssd_triton vs the float64 reference on upcast inputs."""
    ssd_ref = importlib.import_module("mambac.ops.ssd").reference
    s = dict(shape)
    q = s.pop("q")
    ins = inputs(**s, dtype=dtype, **extra)
    args = [ins[k] for k in NAMES]
    leaves = [None if a is None else a.detach().clone().requires_grad_(True) for a in args]
    y, fin = cg.ssd_triton(*leaves[:5], chunk_size=q, D=leaves[5], z=leaves[6], dt_bias=leaves[7],
                           initial_state=leaves[8], dt_softplus=True, dt_min=limit[0], dt_max=limit[1])
    gen = torch.Generator(device=DEV).manual_seed(7)
    gy = torch.randn(y.shape, device=DEV, generator=gen).to(dtype)
    gf = torch.randn(fin.shape, device=DEV, generator=gen)
    ((y.float() * gy.float()).sum() + (fin * gf).sum()).backward()
    ref_in = [None if a is None else a.detach().double().requires_grad_(True) for a in args]
    y64, f64 = ssd_ref(*ref_in, q, True, limit[0], limit[1])
    ((y64 * gy.double()).sum() + (f64 * gf.double()).sum()).backward()
    errs = {"y": rel(y, y64), "final": rel(fin, f64)}
    for name, a, r in zip(NAMES, leaves, ref_in):
        if a is not None:
            errs["d" + name] = rel(a.grad, r.grad)
    worst = max(errs.values())
    tol = 1e-2 if dtype != torch.float32 else 1e-3
    rec(f"check {tag} worst rel err (tol {tol})", f"{worst:.2e} {'ok' if worst <= tol else 'FAIL'}")
    rec(f"check {tag} all", {k: float(f"{v:.2e}") for k, v in errs.items()})
    del y64, f64, ref_in
    torch.cuda.empty_cache()


ODD = dict(z=True, d_dim=True, init=True)
CHECKS = {
    "check": [("S1", S1, {}, torch.bfloat16), ("S2", S2, {}, torch.bfloat16)],
    "check-odd": [("odd L4059 z,Dhd,init,clamp", dict(S1, b=1, l=4059), ODD, torch.bfloat16),
                  ("odd L777 p48 n96 g3 chunk128 clamp", dict(b=2, l=777, h=6, p=48, n=96, g=3, q=128),
                   ODD, torch.bfloat16)],
    "check-fp32": [("fp32 L1000 z,Dhd,init,clamp", dict(b=1, l=1000, h=4, p=64, n=64, g=2, q=256), ODD,
                    torch.float32)],
}


def run_checks(cg, which: str) -> None:
    at = importlib.import_module("mambac.codegen.autotune")
    choose = at.choose
    at.choose = lambda family, bucket, cands, bench: cands[0]  # correctness needs no tuning
    try:
        for tag, shape, extra, dtype in CHECKS[which]:
            limit = (0.001, 0.5) if "clamp" in tag else (0.0, math.inf)
            try:
                check_case(cg, tag, shape, dtype=dtype, limit=limit, **extra)
            except Exception:
                traceback.print_exc()
    finally:
        at.choose = choose
        importlib.import_module("mambac.codegen.ssd_launch")._PLANS.clear()


def warm(cg, slices: int, index: int, lengths: tuple[int, ...] = (256,)) -> None:
    """Launch every k-th autotune candidate once (no timing) at S1 and S2: fills the compile
    cache.  Uses a private mambac cache so that no choice made here is kept."""
    import tempfile
    from mambac import knobs
    at = importlib.import_module("mambac.codegen.autotune")
    seen: dict = {}

    def fake_time(fn):
        seen.setdefault("n", 0)
        seen["n"] += 1
        if seen["n"] % slices != index:
            return 1.0
        fn()
        torch.cuda.synchronize()
        return 1.0

    at.time_ms = fake_time
    with knobs.override(cache_dir=tempfile.mkdtemp()):
        for shape in [dict(s, q=q) for s in (S1, S2) for q in lengths]:
            time_case(cg, None, "warm", shape, fwd_only_timing=False, timed=False)
            at._CHOSEN.clear()


def anchor_call(shape: dict) -> tuple[tuple, dict]:
    """The anchors' recipe at one shape, every input requiring grad, as the positional and keyword
    arguments that both ``ssd_triton`` and mamba_ssm's ``mamba_chunk_scan_combined`` take."""
    s = dict(shape)
    q = s.pop("q")
    ins = inputs(**s)
    x, dt, A, B, C, D, dtb = (ins[k].requires_grad_(True) for k in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    return (x, dt, A, B, C, q), dict(D=D, dt_bias=dtb, dt_softplus=True)


def time_case(cg, mamba, tag: str, shape: dict, fwd_only_timing: bool = False,
              timed: bool = True) -> None:
    args, kw = anchor_call(shape)
    impls = [("mambac", lambda: cg.ssd_triton(*args, **kw)[0])]
    if mamba is not None:
        impls.append(("mamba_ssm", lambda: mamba(*args, **kw)))
    for name, f in impls:
        try:
            dy = torch.randn_like(f())
            f().backward(dy)  # first call: compile and autotune outside the timed region
            if not timed:
                continue
            with torch.no_grad():
                rec(f"{tag} {name} fwd us", round(bench_ms(f) * 1e3, 1))
            if fwd_only_timing:
                continue

            def fb():
                f().backward(dy)
            rec(f"{tag} {name} fwd+bwd us", round(bench_ms(fb) * 1e3, 1))
        except Exception:
            traceback.print_exc()
            continue
        if not GRAPHED:
            continue
        try:  # the same fwd and fwd+bwd from CUDA graphs: the part of the time that is the GPU's
            with torch.no_grad():
                rec(f"{tag} {name} fwd graphed us", round(graphed_ms(f) * 1e3, 1))
            rec(f"{tag} {name} fwd+bwd graphed us", round(graphed_ms(fb) * 1e3, 1))
        except Exception as exc:
            rec(f"{tag} {name} fwd+bwd graphed us", f"not captured: {exc!r}"[:120])
    args = kw = None  # free the inputs before emptying the cache
    torch.cuda.empty_cache()


def forward_pieces(shape: dict):
    """The kernel modules and, at one shape, what the forward leaves for the backward kernels:
    (fk, bk, pr, states, saved, dy, dfin)."""
    fk = importlib.import_module("mambac.codegen.ssd_kernels")
    bk = importlib.import_module("mambac.codegen.ssd_kernels_bwd")
    s = dict(shape)
    q = s.pop("q")
    ins = inputs(**s)
    pr = fk.prepare(ins["x"], ins["dt"], ins["A"], ins["B"], ins["C"], ins["D"], None, ins["dt_bias"],
                    None, q, True, 0.0, math.inf)
    states, dtp, cs = fk.run_chunk_state(pr)
    sin, _ = fk.run_state_pass(pr, states, cs)
    saved = fk.with_cb(pr, fk.SSDSaved(dtp=dtp, cs=cs, sin=sin))
    dy = torch.randn_like(ins["x"])
    dfin = torch.zeros(s["b"], s["h"], s["p"], s["n"], device=ins["x"].device)
    return fk, bk, pr, states, saved, dy, dfin


def time_parts(cg, shape: dict, tag: str = "S1") -> None:
    """Each generated kernel alone at one shape (launch order of fwd, then bwd)."""
    fk, bk, pr, states, saved, dy, dfin = forward_pieces(shape)
    dtp, cs, sin, cb = saved.dtp, saved.cs, saved.sin, saved.cb
    dst = bk.run_dstate(pr, dy, cs)
    dsout, _, dtot = bk.run_state_pass_bwd(pr, dst, saved, dfin)
    _, ddtd, _ = bk.run_dx(pr, dy, saved, dsout)
    dcb, *pairs = bk.run_dcb(pr, dy, saved)
    _, es = bk.run_dbc(pr, "c", dy, saved, sin, dcb)
    _, v = bk.run_dbc(pr, "b", dy, saved, dsout, dcb)
    parts = [("fwd chunk_cb", lambda: fk.run_chunk_cb(pr)),
             ("fwd chunk_state", lambda: fk.run_chunk_state(pr)),
             ("fwd state_pass", lambda: fk.run_state_pass(pr, states, cs)),
             ("fwd state_walk (chunk_state + state_pass as one walk)", lambda: fk.run_state_walk(pr)),
             ("fwd chunk_scan", lambda: fk.run_chunk_scan(pr, dtp, cs, sin, cb)),
             ("fwd fused (chunk state + passing + scan)", lambda: fk.run_fused_forward(pr, cb, True)),
             *[(f"fwd all launches, path {p}", lambda p=p: fk.forward_prepared(pr, path=p))
               for p in fk.FORWARD_PATHS],
             ("bwd chunk_cb (backward's)", lambda: fk.with_cb(pr, replace(saved, cb=None, cbt=None))),
             ("bwd chunk_dstate", lambda: bk.run_dstate(pr, dy, cs)),
             ("bwd state_pass", lambda: bk.run_state_pass_bwd(pr, dst, saved, dfin)),
             ("bwd state_walk_bwd (dstate + state_pass as one walk)",
              lambda: bk.run_state_walk_bwd(pr, dy, saved, dfin)),
             ("bwd dx", lambda: bk.run_dx(pr, dy, saved, dsout)),
             ("bwd dcb", lambda: bk.run_dcb(pr, dy, saved)),
             ("bwd dc", lambda: bk.run_dbc(pr, "c", dy, saved, sin, dcb)),
             ("bwd db", lambda: bk.run_dbc(pr, "b", dy, saved, dsout, dcb)),
             ("bwd dt", lambda: bk.run_dt_backward(pr, saved, ddtd, es, v, tuple(pairs), dtot))]
    timer = graphed_ms if GRAPHED else bench_ms   # with "graphed": each part replayed from a CUDA graph
    for name, fn in parts:
        try:
            rec(f"{tag} part {name} us", round(timer(fn) * 1e3, 1))
        except Exception:
            traceback.print_exc()


# TileConfig fields of tiles to try beside the candidate lists, by family (benchmarks/NOTES_ssd.md):
# none pending; the last ones (v11: descriptor forms of dcb / dB at three stages, of dcb without
# its register cap or at 128, of dx uncapped, a 128-row chunk scan) were slower than the candidates
VARIANTS: dict = {}


def time_variants(tag: str, shape: dict, timer=None) -> None:
    """The kernels of VARIANTS with each of their tiles: time (``timer``, default ``bench_ms``) and
    the largest relative difference of the output from the default tile's."""
    timer = timer or bench_ms
    sl = importlib.import_module("mambac.codegen.ssd_launch")
    TileConfig = importlib.import_module("mambac.codegen.kernel_ir").TileConfig
    fk, bk, pr, _, saved, dy, dfin = forward_pieces(shape)
    dtp, cs, sin = saved.dtp, saved.cs, saved.sin
    dsout = bk.run_state_pass_bwd(pr, bk.run_dstate(pr, dy, cs), saved, dfin)[0]
    dcb = bk.run_dcb(pr, dy, saved)[0]
    d = pr.dims
    runs = {"CHUNK_STATE": (fk, lambda: fk.run_chunk_state(pr)[0]),
            "CHUNK_SCAN": (fk, lambda: fk.run_chunk_scan(pr, dtp, cs, sin, saved.cb)),
            "DX": (bk, lambda: bk.run_dx(pr, dy, saved, dsout)[0]),
            "DCB": (bk, lambda: bk.run_dcb(pr, dy, saved)[0].sum(0)),  # summed over the splits' parts
            "DC": (bk, lambda: bk.run_dbc(pr, "c", dy, saved, sin, dcb)[0]),
            "DB": (bk, lambda: bk.run_dbc(pr, "b", dy, saved, dsout, dcb)[0])}
    for fam_name, tiles in VARIANTS.items():
        module, run = runs[fam_name]
        original = getattr(module, fam_name)
        sl._PLANS.clear()
        ref = run().float()
        try:
            for fields in tiles:
                cfg = TileConfig(**fields)
                if d.hpg % (cfg.heads * cfg.splits):
                    continue
                setattr(module, fam_name, replace(original, candidates=lambda d, c=cfg: [c]))
                sl._PLANS.clear()
                key = f"{tag} variant {original.name} {cfg.to_json()}"
                try:
                    diff = rel(run().float(), ref)
                    rec(f"{key} us", round(timer(run) * 1e3, 1))
                    rec(f"{key} rel diff vs default", f"{diff:.2e}")
                except Exception as exc:
                    rec(f"{key} us", f"failed: {exc!r}"[:160])
        finally:
            setattr(module, fam_name, original)
            sl._PLANS.clear()


def ssd_calls(cg, shape: dict):
    """mambac's SSD on the anchors' recipe at one shape as two closures: the forward (returns y)
    and forward + backward."""
    args, kw = anchor_call(shape)
    dy = torch.randn_like(args[0])

    def fwd():
        return cg.ssd_triton(*args, **kw)[0]

    def fb():
        fwd().backward(dy)

    return fwd, fb


CHUNK_LENGTHS = (256, 128, 64)


def time_chunks(cg) -> None:
    """The same SSD computed with each of CHUNK_LENGTHS: graphed fwd and fwd+bwd at S1 and S2,
    and the S1 check (float64 referee) at each length."""
    for tag, shape in (("S1", S1), ("S2", S2)):
        for q in CHUNK_LENGTHS:
            fwd, fb = ssd_calls(cg, dict(shape, q=q))
            try:
                fb()
                with torch.no_grad():
                    rec(f"{tag} chunk {q} fwd graphed us", round(graphed_ms(fwd) * 1e3, 1))
                rec(f"{tag} chunk {q} fwd+bwd graphed us", round(graphed_ms(fb) * 1e3, 1))
            except Exception:
                traceback.print_exc()
            fwd = fb = None
            torch.cuda.empty_cache()
    for q in CHUNK_LENGTHS:
        try:
            check_case(cg, f"S1 chunk {q}", dict(S1, q=q))
        except Exception:
            traceback.print_exc()


def time_host(cg, tag: str, shape: dict, calls: int = 40) -> None:
    """Host cost of the ungraphed fwd+bwd, Triton's launch path against direct launches."""
    import cProfile
    import io
    import pstats
    import time
    knobs = importlib.import_module("mambac.knobs")
    _, fb = ssd_calls(cg, shape)
    for direct in (False, True) * 3:
        with knobs.override(direct_launch=direct):
            fb()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fb()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rec(f"{tag} host direct={direct} fwd+bwd us (host, wall per call)",
                (round((t1 - t0) / calls * 1e6, 1), round((t2 - t0) / calls * 1e6, 1)))
            rec(f"{tag} host direct={direct} fwd+bwd do_bench us", round(bench_ms(fb) * 1e3, 1))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fb()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(22)
    print(f"cProfile of {calls} direct fwd+bwd calls (times are totals over the calls):")
    print("\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())[:6000], flush=True)


# autotune's choices at S1 in the sixth round's runs where they differ from the first candidate
PINNED = {"ssd_dcb": dict(block_m=64, block_k=64, heads=2, splits=4, num_warps=4, num_stages=2, maxnreg=168),
          "ssd_state_pass": dict(block_m=1024, block_k=64, num_warps=4, num_stages=2),
          "ssd_state_pass_bwd": dict(block_m=1024, block_k=64, num_warps=4, num_stages=2)}


def time_streams(cg, tag: str, shape: dict) -> None:
    """The backward's pair chain beside its state chain (codegen/streams.py) or after it."""
    knobs = importlib.import_module("mambac.knobs")
    at = importlib.import_module("mambac.codegen.autotune")
    TileConfig = importlib.import_module("mambac.codegen.kernel_ir").TileConfig
    choose = at.choose

    def pinned(family, bucket, cands, bench):
        want = PINNED.get(family.split("-")[0])
        return next((c for c in cands if want is not None and c == TileConfig(**want)), cands[0])

    fwd, fb = ssd_calls(cg, shape)

    at.choose = pinned
    try:
        for conc in (False, True) * 2:
            with knobs.override(ssd_streams=conc):
                fb()
                with torch.no_grad():
                    rec(f"{tag} streams concurrent={conc} fwd us", round(bench_ms(fwd) * 1e3, 1))
                rec(f"{tag} streams concurrent={conc} fwd+bwd graphed us", round(graphed_ms(fb) * 1e3, 1))
                rec(f"{tag} streams concurrent={conc} fwd+bwd us", round(bench_ms(fb) * 1e3, 1))
    except Exception as exc:
        rec(f"{tag} streams", f"failed: {exc!r}"[:200])
    finally:
        at.choose = choose
        importlib.import_module("mambac.codegen.ssd_launch")._PLANS.clear()


def summary() -> None:
    print("\n| shape | impl | fwd us | fwd graphed us | fwd+bwd us | fwd+bwd graphed us |\n|---|---|---|---|---|---|")
    for tag in ("S1", "S2"):
        for name in ("mambac", "mamba_ssm"):
            f, fb = RES.get(f"{tag} {name} fwd us"), RES.get(f"{tag} {name} fwd+bwd us")
            if f is not None:
                print(f"| {tag} | {name} | {f} | {RES.get(f'{tag} {name} fwd graphed us', '-')} | {fb} | "
                      f"{RES.get(f'{tag} {name} fwd+bwd graphed us', '-')} |")
        m, o = RES.get(f"{tag} mamba_ssm fwd us"), RES.get(f"{tag} mambac fwd us")
        if m and o:
            print(f"| {tag} | anchor ratio (this run / ANCHORS) | {m / ANCHOR_US[(tag, 'fwd')]:.2f} | - | "
                  f"{RES.get(f'{tag} mamba_ssm fwd+bwd us', 0) / ANCHOR_US[(tag, 'fwd+bwd')]:.2f} | - |")
            print(f"| {tag} | mamba_ssm / mambac | {m / o:.2f}x | {_ratio(tag, 'fwd graphed')} | "
                  f"{_ratio(tag, 'fwd+bwd')} | {_ratio(tag, 'fwd+bwd graphed')} |")


def _ratio(tag: str, what: str) -> str:
    """mamba_ssm's time over mambac's for one measurement, when both are numbers."""
    m, o = RES.get(f"{tag} mamba_ssm {what} us"), RES.get(f"{tag} mambac {what} us")
    return f"{m / o:.2f}x" if isinstance(m, float) and isinstance(o, float) and o > 0 else "-"


def main(argv: list[str]) -> None:
    what = argv or ["check", "time", "parts"]
    if DEV != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("bench_ssd measures the generated kernels on a CUDA GPU at the anchors' shapes, and this "
                         "machine has none. On a CPU, TRITON_INTERPRET=1 runs them in Triton's interpreter "
                         "(hours at these shapes); the CPU checks are the test suite's (tests/codegen).")
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mambac.codegen").setLevel(logging.INFO)
    import triton
    rec("torch", torch.__version__)
    rec("triton", triton.__version__)
    rec("gpu", torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)")
    cg = import_codegen()
    if what[0] == "warm":
        lengths = tuple(int(q) for q in what[3].split(",")) if len(what) > 3 else (256,)
        warm(cg, int(what[1]), int(what[2]), lengths)
        return
    global GRAPHED
    GRAPHED = "graphed" in what and DEV == "cuda"
    mamba = import_mamba_ssm()
    rec("mamba_ssm available", mamba is not None)
    if "time" in what:
        time_case(cg, mamba, "S1", S1)
        time_case(cg, mamba, "S2", S2)
    if "parts" in what:
        time_parts(cg, S1)
    if "parts-s2" in what:
        time_parts(cg, S2, "S2")
    if "chunks" in what:
        time_chunks(cg)
    if "host" in what:
        time_host(cg, "S1", S1)
    if "variants" in what:
        time_variants("S1", S1)
        time_variants("S2", S2)
    for which in CHECKS:   # with the knobs in force (two streams unless MAMBAC_SSD_STREAMS=0)
        if which in what:
            run_checks(cg, which)
    if "streams" in what:
        time_streams(cg, "S1", S1)
        time_streams(cg, "S2", S2)
    at = importlib.import_module("mambac.codegen.autotune")
    rec("autotune choices", {f"{k[0].split('-')[0]} {k[1]}": v.to_json() for k, v in at._CHOSEN.items()})
    summary()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, f"bench_ssd_{'_'.join(what)}.json"), "w") as f:
            json.dump(RES, f, indent=1, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
