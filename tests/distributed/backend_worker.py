"""One rank of ``torch.compile(model, backend="mambac", options={"world_size": W, ...})`` against
single-process eager (``python -m tests.distributed.backend_worker SCENARIO``, started by
``harness.run_ranks``).

Every rank builds the same tiny LM (same seed) and passes the same full batch.  Each configuration
compiles a fresh copy with the backend, trains one step's worth (logits, then loss and backward)
and reports the relative errors of the logits, the loss and every parameter's gradient against an
eager copy of the same model in the same process, plus the backend's counts of collectives.
"""
from __future__ import annotations

import copy
import datetime
import json
import os
import sys

import torch
import torch._dynamo
import torch.distributed as dist

from tests.helpers import rel_err
from tests.models.tiny import tiny_lm

M2_GROUPS = dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4, ngroups=2)
M3 = dict(layer="Mamba3", d_state=8, headdim=8, chunk_size=4)
# name -> (tiny_lm variant, overrides, backend options without world_size, sequence lengths); the
# second length makes dynamo compile a graph with a symbolic length, which a third one reuses (under
# cp the backend then lowers that length's program at run time)
WORLD2 = {
    "tp2_mamba2": ("mamba2", {}, dict(tp=2), (9,)),
    "tp2_sp_mamba2_groups": ("mamba2", dict(n_layer=1, ssm_cfg=M2_GROUPS), dict(tp=2, sequence_parallel=True), (8,)),
    "cp2_mamba2": ("mamba2", dict(n_layer=1), dict(cp=2), (9, 12, 7)),
    "tp2_mamba3_remat": ("mamba2", dict(n_layer=1, ssm_cfg=M3), dict(tp=2, remat="full"), (8,)),
    "tp2_mamba2_dynamic": ("mamba2", dict(n_layer=1), dict(tp=2), (9, 12)),
}
WORLD4 = {
    "tp2xcp2_mamba2_groups": ("mamba2", dict(n_layer=1, ssm_cfg=M2_GROUPS), dict(tp=2, cp=2), (9,)),
}
BY_NAME = ("cp2_mamba2",)  # compiled as backend="mambac", options={...} (the others with MambacBackend)
DYNAMIC = ("tp2_mamba2_dynamic",)  # torch.compile(..., dynamic=True): floats such as dt_limit become inputs


def batch(seqlen: int, b: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seqlen)
    return torch.randint(0, 37, (b, seqlen), generator=g), torch.randint(0, 37, (b, seqlen), generator=g)


def _grad_errors(model, eager) -> dict[str, float]:
    ref = dict(eager.named_parameters())
    return {name: rel_err(p.grad, ref[name].grad) for name, p in model.named_parameters()}


def check(name: str, variant: str, over: dict, opts: dict, lengths: tuple[int, ...], world: int) -> dict:
    """Worst errors of the compiled model against eager over ``lengths`` (logits, loss, every
    parameter gradient), then the loss after one optimizer step on both."""
    from torch._dynamo.utils import counters
    from mambac.backend import MambacBackend
    torch._dynamo.reset()
    counters.clear()
    model = tiny_lm(variant, seed=0, **over)
    eager = copy.deepcopy(model)
    backend = "mambac" if name in BY_NAME else MambacBackend(world_size=world, **opts)
    options = dict(world_size=world, **opts) if name in BY_NAME else None
    compiled = torch.compile(model, backend=backend, options=options, dynamic=True if name in DYNAMIC else None)
    out = {"logits": 0.0, "loss": 0.0, "grad": 0.0, "worst_grad": ""}
    for L in lengths:
        ids, labels = batch(L)
        out["logits"] = max(out["logits"], rel_err(compiled(ids), eager(ids)))
        model.zero_grad()
        eager.zero_grad()
        loss_c, loss_e = compiled(ids, labels), eager(ids, labels)
        out["loss"] = max(out["loss"], rel_err(loss_c, loss_e))
        loss_c.backward()
        loss_e.backward()
        errs = _grad_errors(model, eager)
        worst = max(errs, key=errs.get)
        if errs[worst] >= out["grad"]:
            out["grad"], out["worst_grad"] = errs[worst], f"{worst}@{L}"
    for m in (model, eager):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    ids, labels = batch(lengths[0])
    out["after_step"] = rel_err(compiled(ids, labels), eager(ids, labels))
    out["graphs"] = counters["mambac"]["graphs"]
    out["replicated"] = counters["mambac"]["graphs.replicated"]
    if name not in BY_NAME:  # this rank's program holds its shards: local in_proj rows
        program = backend.graphs[-1].gm
        full = model.get_parameter("backbone.layers.0.mixer.in_proj.weight").shape[0]
        out["in_proj_rows"] = [program.get_parameter("backbone.layers.0.mixer.in_proj.weight").shape[0], full]
        out["passes"] = [stage for stage, _ in backend.graphs[-1].ctx.history]
    return out


def check_mixer(world: int, **opts) -> dict:
    """A bare Mamba-2 mixer on float inputs that require grad: output, input gradient and every
    parameter gradient against eager (under cp each rank's piece's gradient must come back whole)."""
    from mambac.models.mamba2 import Mamba2
    torch._dynamo.reset()
    torch.manual_seed(0)
    mixer = Mamba2(d_model=16, d_state=8, headdim=8, chunk_size=4)
    eager = copy.deepcopy(mixer)
    compiled = torch.compile(mixer, backend="mambac", options=dict(world_size=world, **opts))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 9, 16, generator=g)
    x_c, x_e = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_c, y_e = compiled(x_c), eager(x_e)
    cot = torch.randn(y_e.shape, generator=g)
    (y_c * cot).sum().backward()
    (y_e * cot).sum().backward()
    return {"out": rel_err(y_c, y_e), "input_grad": rel_err(x_c.grad, x_e.grad),
            "grad": max(_grad_errors(mixer, eager).values())}


def scenario_parity(world: int) -> dict:
    table = WORLD2 if world == 2 else WORLD4
    import time
    res = {}
    for name, cfg in table.items():
        t0 = time.monotonic()
        res[name] = check(name, *cfg, world)
        res[name]["seconds"] = round(time.monotonic() - t0, 2)
    if world == 2:
        res["mixer_cp2"] = check_mixer(world, cp=2)
        res["errors"] = scenario_errors(world)
        res["replicated"] = check_replicated(world)
    res["rank"] = dist.get_rank()
    return res


class _Broken(torch.nn.Module):
    """An LM whose forward dynamo must split in two (an explicit graph break)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.lm(ids)
        torch._dynamo.graph_break()
        return logits * 2


def _message(fn) -> str:
    """The text of the mambac error ``fn`` raises (unwrapped from dynamo's BackendCompilerFailed)."""
    from mambac.errors import MambacError
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- the type is reported, and checked by the test
        inner = getattr(exc, "inner_exception", exc)
        return f"{type(inner).__name__}: {inner}" if isinstance(inner, MambacError) else f"not mambac's: {exc!r}"
    return ""


def check_replicated(world: int) -> dict:
    """Graphs that are not a model's whole forward (the two pieces around a graph break, a compiled
    lambda) run whole on every rank with a warning: logits and every gradient equal eager's."""
    import warnings
    from torch._dynamo.utils import counters
    out = {}
    for name, wrap in (("graph_break", _Broken), ("function", None)):
        torch._dynamo.reset()
        counters.clear()
        lm = tiny_lm("mamba2", n_layer=1)
        eager = copy.deepcopy(lm)
        target = _Broken(lm) if wrap else (lambda t, lm=lm: lm(t) * 2)
        compiled = torch.compile(target, backend="mambac", options={"world_size": world, "tp": world})
        ids = batch(6)[0]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = compiled(ids)
        y_e = eager(ids) * 2
        cot = torch.randn(y_e.shape, generator=torch.Generator().manual_seed(3))
        (y * cot).sum().backward()
        (y_e * cot).sum().backward()
        out[name] = {"out": rel_err(y, y_e), "grad": max(_grad_errors(lm, eager).values()),
                     "replicated": counters["mambac"]["graphs.replicated"],
                     "warning": next((str(w.message) for w in caught if "runs unsplit" in str(w.message)), "")}
    return out


def scenario_errors(world: int) -> dict:
    """The clear errors: a world size the process group does not have and dp (both before anything
    is lowered)."""
    from mambac.backend import MambacBackend
    torch._dynamo.reset()
    ids = batch(6)[0]
    lm = tiny_lm("mamba2", n_layer=1)
    return {
        "mismatch": _message(lambda: MambacBackend(world_size=world * 2, tp=world * 2)),
        "mismatch_by_name": _message(lambda: torch.compile(lm, backend="mambac", options={"world_size": world + 1,
                                                                                          "tp": world + 1})(ids)),
        "dp": _message(lambda: MambacBackend(world_size=world, dp=world)),
        "rank": dist.get_rank(),
    }


def main() -> None:
    scenario = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    result = {"parity": scenario_parity, "errors": scenario_errors}[scenario](world)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
