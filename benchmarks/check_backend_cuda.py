"""The torch.compile backend on CUDA: parity with eager and the graphs compiled per new length.

For the tiny Mamba-2, Mamba-1 and Mamba-3 SISO LMs (fp32, on the GPU) compiled with
``MambacBackend``, runs lengths 16, 24 and 37 (forward, loss and backward) and prints, per model,
how many graphs the backend lowered (2 means a static graph, then one dynamic graph for every later
length) and the worst relative error of the loss and gradients against eager.  Dynamo's
recompile reasons are printed as they happen (``TORCH_LOGS=recompiles``), so a length that
compiles again says which guard failed.

Usage (a CUDA machine, from the repository root):
``python3 benchmarks/check_backend_cuda.py [0|1] [--guards] [variant ...]`` (1, the default: backward
through AOTAutograd; 0: ``trace_backward=False``; variants: any of mamba2, mamba1, mamba3_siso, default
all).  ``--guards`` also prints every size symbol that a graph's shape environment replaces by a
constant, with the FX node being run at that moment, its inputs' fake shapes and strides, and
the Python frames outside torch's shape machinery: where a length gets pinned.
"""
from __future__ import annotations

import copy
import sys
import traceback

import torch
import torch._dynamo

sys.path.insert(0, ".")
from mambac.backend import MambacBackend  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.models.tiny import tiny_lm  # noqa: E402


VARIANTS = ("mamba2", "mamba1", "mamba3_siso")


def trace_specialisations() -> None:
    """Print each replacement of a size symbol by a number, with the frames that asked for it."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    original, run_node = ShapeEnv._set_replacement, torch.fx.Interpreter.run_node
    machinery = ("symbolic_shapes.py", "recording.py", "sym_node.py", "fake_tensor.py", "_stats.py",
                 "torch/__init__.py")
    running: list = []

    def traced(self, a, tgt, msg):
        if getattr(tgt, "is_number", False):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(machinery)]
            where = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:10])
            node = running[-1].format_node() if running else "-"
            print(f"specialised {a} = {tgt} ({msg}) running node {node} at {where}", flush=True)
            if running:
                vals = [(x.name, tuple(v.shape), v.stride(), v.dtype, type(v).__name__)
                        for x in running[-1].all_input_nodes if hasattr(v := x.meta.get("val"), "stride")]
                print(f"  its inputs (name, shape, stride, dtype, type): {vals}", flush=True)
        return original(self, a, tgt, msg)

    def run_traced(self, n):
        running.append(n)
        try:
            return run_node(self, n)
        finally:
            running.pop()
    ShapeEnv._set_replacement = traced
    torch.fx.Interpreter.run_node = run_traced


def main(trace_backward: bool, variants: tuple[str, ...] = VARIANTS) -> None:
    torch._logging.set_logs(recompiles=True)
    torch.manual_seed(0)
    for variant in variants:
        m = tiny_lm(variant).cuda()
        e = copy.deepcopy(m)
        be = MambacBackend(trace_backward=trace_backward)
        torch._dynamo.reset()
        c = torch.compile(m, backend=be)
        worst = 0.0
        for L in (16, 24, 37):
            ids = torch.randint(0, 37, (2, L), device="cuda")
            lab = torch.randint(0, 37, (2, L), device="cuda")
            m.zero_grad()
            e.zero_grad()
            lc, le = c(ids, lab), e(ids, lab)
            lc.backward()
            le.backward()
            ref = dict(e.named_parameters())
            worst = max([worst, rel_err(lc, le)] + [rel_err(p.grad, ref[n].grad) for n, p in m.named_parameters()])
        print(f"backend on CUDA {variant}: trace_backward={be.trace_backward} graphs={len(be.graphs)} "
              f"worst rel err {worst:.2e}", flush=True)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("check_backend_cuda runs the backend on a CUDA GPU, and this machine has none; the CPU "
                         "checks of the backend are the test suite's (tests/test_backend*.py).")
    args = sys.argv[1:]
    flag = args.pop(0) if args and args[0] in ("0", "1") else "1"
    if "--guards" in args:
        args.remove("--guards")
        trace_specialisations()
    unknown = [a for a in args if a not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {VARIANTS}")
    main(flag == "1", tuple(args) or VARIANTS)
