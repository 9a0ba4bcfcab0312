"""Host-side cost of a training step with and without rematerialisation: the Python and PyTorch
dispatch a step spends per ``remat`` mode, with the generated kernels' launches stubbed out (no GPU
needed; what a step costs the host when it is not replayed from a CUDA graph).

Usage, from the repository root (any machine):

    python benchmarks/remat_host_overhead.py [--layers 24] [--steps 5]

A Mamba-2 LM with the 130M model's layer count and block structure at tiny sizes (d_model 64,
batch 1 x 64 tokens: the launchers' and the checkpoints' work does not depend on the sizes; the
PyTorch ops that run on the CPU here are small) is compiled with ``kernels="triton"`` for
remat 'none', 'auto' without a budget (every cheap region: conv, scan, gated norm per block) and
'full', and one forward + backward is timed per mode, with the regions run by ``mambac.runtime.replay``
(as they are) and under non-reentrant ``torch.utils.checkpoint`` (median of --steps, the forms
taking turns).  Prints milliseconds per
step and what remat adds; first, a 9-op body's forward + backward plain and under
``torch.utils.checkpoint``.  What it leaves out: Triton's own launch path and the GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

os.environ.setdefault("TRITON_INTERPRET", "1")   # lets kernels='triton' run on CPU tensors; launches are stubbed
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    import mambac
    from mambac.models import MambaConfig, MambaLMHeadModel
    from ssd_host_overhead import stub_kernel_launches
    stub_kernel_launches()
    cfg = MambaConfig(d_model=64, n_layer=args.layers, vocab_size=256,
                      ssm_cfg=dict(layer="Mamba2", d_state=16, headdim=16, chunk_size=32))
    torch.manual_seed(0)
    model = MambaLMHeadModel(cfg)
    ids = torch.randint(0, 256, (1, 64))
    labels = torch.randint(0, 256, (1, 64))
    compiled, regions = {}, {}
    for mode in ("none", "auto", "full"):
        compiled[mode] = mambac.compile(model, kernels="triton", remat=mode, example_inputs=(ids, labels))
        regions[mode] = compiled[mode].program_for(ids, labels).ctx.count("plan_remat", "regions")
        compiled[mode](ids, labels).backward()          # first call's set-up out of the timing
    forms = [("none", "", compiled["none"])]
    for mode in ("auto", "full"):
        forms += [(mode, "replay", compiled[mode]), (mode, "checkpoint", compiled[mode])]
    times: dict[tuple[str, str], list[float]] = {f[:2]: [] for f in forms}
    for _ in range(args.steps):                          # forms interleaved: drifts in the host's speed hit all alike
        for mode, how, fn in forms:
            with regions_under_checkpoint(how == "checkpoint"):
                t = time.perf_counter()
                fn(ids, labels).backward()
                times[(mode, how)].append(time.perf_counter() - t)
    checkpoint_table(args.steps)
    base = statistics.median(times[("none", "")]) * 1e3
    print(f"| remat ({args.layers} layers, launches stubbed, torch {torch.__version__}) | regions run by | "
          f"regions | host ms per step | added by remat |")
    print("|---|---|---|---|---|")
    for mode, how, _ in forms:
        ms = statistics.median(times[(mode, how)]) * 1e3
        print(f"| {mode} | {how or '-'} | {regions[mode]} | {ms:.1f} | {ms - base:+.1f} |")


@contextlib.contextmanager
def regions_under_checkpoint(on: bool) -> Iterator[None]:
    """With ``on``, the regions run under non-reentrant ``torch.utils.checkpoint`` (as they did before
    ``mambac.runtime.replay``) instead of the replay: the comparison the second table makes."""
    from mambac.passes.plan_remat import RematRegion

    if not on:
        yield
        return
    own = RematRegion.forward
    RematRegion.forward = RematRegion.checkpointed
    try:
        yield
    finally:
        RematRegion.forward = own


def checkpoint_table(repeats: int, calls: int = 300) -> None:
    """Microseconds per forward + backward of a 9-op elementwise body on 64 floats: plain, under
    ``torch.utils.checkpoint`` (non-reentrant and reentrant) and under ``mambac.runtime.replay``
    (as ``plan_remat``'s regions run; the median of ``repeats`` groups of ``calls``)."""
    from torch.utils.checkpoint import checkpoint

    from mambac.runtime.replay import replay

    def body(x, w):
        y = x * w
        for _ in range(4):
            y = torch.tanh(y) * w
        return y

    x, w = torch.randn(64, requires_grad=True), torch.randn(64, requires_grad=True)
    forms = (("plain", lambda: body(x, w)),
             ("checkpoint, non-reentrant", lambda: checkpoint(body, x, w, use_reentrant=False,
                                                              preserve_rng_state=False)),
             ("checkpoint, reentrant", lambda: checkpoint(body, x, w, use_reentrant=True, preserve_rng_state=False)),
             ("mambac.runtime.replay (plan_remat's regions)", lambda: replay(body, (x, w), "reference", {})))
    print("| 9-op body, forward + backward | µs per call |")
    print("|---|---|")
    for name, fn in forms:
        fn().sum().backward()   # first-call set-up out of the timing
        groups = []
        for _ in range(max(1, repeats)):
            t = time.perf_counter()
            for _ in range(calls):
                fn().sum().backward()
            groups.append((time.perf_counter() - t) / calls * 1e6)
        print(f"| {name} | {statistics.median(groups):.0f} |")
    print()


if __name__ == "__main__":
    main()
