"""Rematerialisation benchmark: saved-for-backward memory, peak memory and training throughput of
the Mamba-2 130M LM at batch 8 x 2048 under bf16 autocast, with remat none, full and auto
(memory_budget 8 GiB).

    python benchmarks/bench_remat.py                 # CUDA: mamba2-130m, 8 x 2048, bf16 autocast
    python benchmarks/bench_remat.py --budget-gib 4  # another budget for 'auto'
    python benchmarks/bench_remat.py --fit-peak      # 'auto' budget = 8 GiB minus what 'none' needs besides
                                                     # saved activations, so the peak itself aims at 8 GiB
    python benchmarks/bench_remat.py --budget-scope step   # 'auto' budgets the whole step: 8 GiB covers
                                                           # parameters, gradients and AdamW state too
    python benchmarks/bench_remat.py --optimizer     # each timed step also takes an AdamW step (fused on
                                                     # CUDA), so the peak holds its two moments
    python benchmarks/bench_remat.py --profile       # CUDA: each mode's GPU kernel time by kind and wall time
    python benchmarks/bench_remat.py --cuda-graphs   # CUDA: every mode compiled with cuda_graphs=True
    python benchmarks/bench_remat.py --tiny          # CPU: a tiny model and batch (checks the script)

One row per mode: the budget, the saved-for-backward bytes mambac.memory predicts, the same bytes
measured with saved-tensor hooks on a real step, the peak device memory of a training step
(CUDA only: torch.cuda.max_memory_allocated, weights and gradients included, as ANCHORS measures
peaks; with --cuda-graphs the most over the warm-up, the capture and the replays, since a replay
allocates nothing), the memory reserved while the timed steps ran (with --cuda-graphs the graphs'
private pool included) and tokens per
second of forward + backward (mean over the timed steps) and its ratio to remat='none'.  The last
line checks the issue's goal for 'auto': peak <= budget at >= 0.8x the tokens/s of 'none'.  With
--tiny the budget defaults to 60% of what 'none' keeps, so that 'auto' has something to do at that
size (CPU: no peak figure).
"""
from __future__ import annotations

import argparse
import gc
import time
import traceback
from dataclasses import dataclass

import torch

import mambac
from mambac.memory import MEMORY_PLAN, human, measure_saved, plan_of
from mambac.passes.plan_remat import step_state_bytes
from mambac.presets import build_preset

GIB = 2 ** 30


@dataclass
class Row:
    mode: str
    budget: int | None = None
    predicted: int | None = None
    measured: int | None = None
    peak: int | None = None          # torch.cuda.max_memory_allocated over the step (ANCHORS' peak)
    reserved: int | None = None      # torch.cuda.max_memory_reserved while the timed steps ran
    tokens_per_s: float | None = None
    ratio: float | None = None       # tokens/s over remat='none''s
    error: str = ""
    fixed: int = 0                   # what memory_budget_scope='step' counts besides activations


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU, tiny model and batch (a quick check)")
    p.add_argument("--preset", default=None, help="model preset (default mamba2-130m, or mamba2-tiny with --tiny)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seqlen", type=int, default=None)
    p.add_argument("--budget-gib", type=float, default=None, help="memory_budget for remat='auto' (default 8)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode")
    p.add_argument("--modes", default="none,full,auto")
    p.add_argument("--budget-scope", default="activations", choices=("activations", "step"),
                   help="memory_budget_scope of 'auto': the saved activations, or the whole step (plus "
                        "parameters, gradients and AdamW state)")
    p.add_argument("--optimizer", action="store_true",
                   help="an AdamW step (fused on CUDA) after every backward: the peak then holds its state")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: compile with cuda_graphs=True (every mode), so the host's launch time is out of "
                        "the step; the saved-tensor measurement is skipped, the peak allocated is the most over "
                        "the warm-up, the capture and the replays, and the peak reserved includes the graphs' "
                        "pool (measured after the warm-up's cache is emptied)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: after each mode's timed steps, profile 2 more and print their GPU kernel time by "
                        "kind against the wall time (step_profile.py)")
    p.add_argument("--fit-peak", action="store_true",
                   help="CUDA: give 'auto' the budget minus what 'none' needs besides its saved activations "
                        "(its peak minus its measured saved bytes: weights, gradients, transients)")
    args = p.parse_args(argv)
    tiny = dict(preset="mamba2-tiny", batch=2, seqlen=32, steps=1, warmup=0)
    full = dict(preset="mamba2-130m", batch=8, seqlen=2048, steps=5, warmup=2)
    for key, value in (tiny if args.tiny else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _device(args: argparse.Namespace) -> torch.device:
    if args.tiny:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("bench_remat needs a CUDA device for the full-size run; use --tiny on a CPU.")
    return torch.device("cuda")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


def _step(compiled, ids, labels, device, opt=None) -> None:
    with _autocast(device):
        loss = compiled(ids, labels)
    loss.backward()
    if opt is not None:
        opt.step()


def run_mode(model, ids, labels, mode: str, budget: int | None, args, device) -> Row:
    """Compile for one remat mode, predict, measure one step's saved bytes, then time steps."""
    row = Row(mode=mode, budget=budget if mode == "auto" else None)
    opts = dict(remat=mode, memory_budget=budget, memory_budget_scope=args.budget_scope) if mode == "auto" \
        else dict(remat=mode)
    if args.cuda_graphs:
        opts["cuda_graphs"] = True
    with _autocast(device):  # lowered under the autocast it runs with (its own region: see docs/memory.md)
        compiled = mambac.compile(model, example_inputs=(ids, labels), **opts)
        gm = compiled.program_for(ids, labels).gm
        row.predicted = (gm.meta.get(MEMORY_PLAN) or plan_of(gm)).predicted
        row.fixed = step_state_bytes(gm, args.cuda_graphs)
    params = list(model.parameters())
    model.zero_grad(set_to_none=True)
    if not args.cuda_graphs:   # a replayed graph saves nothing through autograd's hooks
        with _autocast(device):
            saved = measure_saved(compiled, ids, labels, exclude=params + [ids, labels])
        row.measured = saved.nbytes
        saved.output.backward()
        del saved
    opt = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda") if args.optimizer else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(max(args.warmup, 1 if opt else 0)):  # AdamW's state exists before the timed steps
        model.zero_grad(set_to_none=True)
        _step(compiled, ids, labels, device, opt)
    warm_peak = 0
    if device.type == "cuda":
        if args.cuda_graphs:
            # the capture allocates the step's tensors in the pool: their live peak (a replay
            # allocates nothing, so the timed steps' own figure leaves the pool's tensors out)
            warm_peak = torch.cuda.max_memory_allocated()
            print(f"remat={mode}: peak allocated over the warm-up steps and the capture {human(warm_peak)}")
            # the warm-up's cached blocks go back: what stays reserved is what the step holds
            gc.collect()
            torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        model.zero_grad(set_to_none=True)
        _step(compiled, ids, labels, device, opt)
    _sync(device)
    row.tokens_per_s = ids.numel() * args.steps / (time.perf_counter() - t0)
    if device.type == "cuda":
        row.peak = max(warm_peak, torch.cuda.max_memory_allocated())
        row.reserved = torch.cuda.max_memory_reserved()   # with graphs: their private pool included
    if args.profile and device.type == "cuda":
        from step_profile import print_profile, profile_steps

        def step():
            model.zero_grad(set_to_none=True)
            _step(compiled, ids, labels, device, opt)
        print(f"\nremat={mode}:", end="")
        print_profile(profile_steps(step, 2))
    return row


def _fmt(row: Row) -> list[str]:
    size = lambda v: "-" if v is None else human(v)  # noqa: E731
    if row.error:
        return [row.mode, size(row.budget), "error: " + row.error, "", "", "", "", ""]
    return [row.mode, size(row.budget), size(row.predicted), size(row.measured), size(row.peak),
            size(row.reserved), f"{row.tokens_per_s:,.0f}", "-" if row.ratio is None else f"{row.ratio:.2f}x"]


def verdict(rows: list[Row], goal: int | None) -> str:
    """The issue's goal for 'auto': peak (CUDA) within ``goal`` at >= 0.8x the tokens/s of 'none'."""
    auto = next((r for r in rows if r.mode == "auto" and not r.error), None)
    if auto is None or auto.ratio is None:
        return "goal: needs an 'auto' and a 'none' row"
    speed = f"tokens/s {auto.ratio:.2f}x of none ({'>=' if auto.ratio >= 0.8 else '<'} 0.8x)"
    if auto.peak is None or goal is None:
        return f"goal: {speed}; peak not measured (CPU)"
    met = auto.peak <= goal and auto.ratio >= 0.8
    return (f"goal {'MET' if met else 'NOT met'}: peak {human(auto.peak)} vs {human(goal)}, {speed} "
            f"(peak: max_memory_allocated, as ../ANCHORS measures it; reserved {human(auto.reserved)})")


def print_table(rows: list[Row], title: str) -> None:
    head = ["remat", "budget", "predicted saved", "measured saved", "peak allocated", "peak reserved", "tokens/s",
            "vs none"]
    body = [_fmt(r) for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    print(title)
    for line in [head, ["-" * w for w in widths]] + body:
        print(" | ".join(x.ljust(w) for x, w in zip(line, widths)))


def main(argv: list[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = _device(args)
    model = build_preset(args.preset, device=device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch, args.seqlen), generator=gen).to(device)
    labels = torch.randint(0, vocab, (args.batch, args.seqlen), generator=gen).to(device)
    budget = None if args.budget_gib is None else int(args.budget_gib * GIB)
    if budget is None and not args.tiny:
        budget = 8 * GIB
    goal = budget
    rows = []
    for mode in args.modes.split(","):
        none = next((r for r in rows if r.mode == "none" and r.predicted and not r.error), None)
        if mode == "auto" and budget is None:  # --tiny: 60% of what 'none' keeps (and, scope 'step', the rest)
            budget = int(0.6 * none.predicted) + (none.fixed if args.budget_scope == "step" else 0) if none else None
            goal = budget
        elif mode == "auto" and args.fit_peak and none is not None and None not in (none.peak, none.measured):
            budget = budget - (none.peak - none.measured)
        try:
            rows.append(run_mode(model, ids, labels, mode, budget, args, device))
        except (mambac.MambacError, torch.OutOfMemoryError) as exc:
            traceback.print_exc()   # the whole story on stderr; the table keeps its first line
            rows.append(Row(mode=mode, budget=budget, error=str(exc).splitlines()[0][:160]))
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
    none = next((r for r in rows if r.mode == "none" and not r.error), None)
    for r in rows:
        if none is not None and not r.error:
            r.ratio = r.tokens_per_s / none.tokens_per_s
    print_table(rows, f"{args.preset}, batch {args.batch} x {args.seqlen}, bf16 autocast, {device.type}, "
                      f"{args.steps} timed steps (forward + backward{' + AdamW' if args.optimizer else ''})")
    print(verdict(rows, goal))
    return rows


if __name__ == "__main__":
    main()
