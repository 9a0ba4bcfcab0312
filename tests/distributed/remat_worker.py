"""Rematerialisation on several ranks (run by ``worker.py remat`` on 2 gloo ranks).

For each layout (tp, tp with sequence parallelism, dp, cp on generated kernels) the same model is compiled three times on
every rank: without remat, with ``remat='full'`` and with ``remat='auto'`` under a budget halfway
between the least reachable and no remat (the same figure on every rank).  Each reports, per
rank: logits and local gradients against the no-remat run (exactly equal in fp32?), the
saved-for-backward bytes of one forward measured with saved-tensor hooks against the plan's
prediction for this rank's program, and whether any recompute region holds a collective that
communicates in its forward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import mambac
from mambac.memory import MEMORY_PLAN, measure_saved
from mambac.passes.plan_remat import RematRegion, communicates, make_plan
from mambac.runtime.collectives import collective_name
from tests.models.tiny import MAMBA2, tiny_lm

LAYOUTS = {
    "mamba2_tp2": ("mamba2", {}, dict()),
    "mamba1_tp2": ("mamba1", {}, dict()),   # x_proj's all-reduce sits inside the block
    "mamba2_groups_tp2_sp": ("mamba2", dict(ssm_cfg=dict(MAMBA2, ngroups=2)), dict(sequence_parallel=True)),
    "mamba2_dp2": ("mamba2", {}, dict(dp=2)),
    # generated kernels under the interpreter (the test sets TRITON_INTERPRET=1): cp_ssd's fused form
    # runs, and the fake run that predicts its saved bytes mirrors it (cp_ssd_fused.FakeCPSSD)
    "mamba2_cp2_kernels": ("mamba2", {}, dict(tp=1, cp=2, kernels="triton")),
}
# the interpreted layout runs one layer on one sequence (every kernel it launches is interpreted)
SMALL = {"mamba2_cp2_kernels": dict(n_layer=1, b=1)}


def _batch(seed: int = 5, b: int = 4, seqlen: int = 12):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 37, (b, seqlen), generator=g), torch.randint(0, 37, (b, seqlen), generator=g)


def _step(compiled, ids, labels) -> tuple[int, dict[str, torch.Tensor]]:
    """Saved bytes of one forward (local parameters and inputs excluded) and the local gradients."""
    params = dict(compiled.named_parameters())
    for p in params.values():
        p.grad = None
    got = measure_saved(compiled, ids, labels, exclude=[*params.values(), ids, labels])
    got.output.backward()
    return got.nbytes, {k: p.grad.clone() for k, p in params.items()}


def _forward_comms(gm) -> list[str]:
    return [collective_name(n) for n in gm.graph.nodes if communicates(n)]


def _check(name: str, world: int) -> dict:
    family, over, layout = LAYOUTS[name]
    small = SMALL.get(name, {})
    model = tiny_lm(family, n_layer=small.get("n_layer", 2), **over)
    ids, labels = _batch(b=small.get("b", 4))
    plain = mambac.compile(model, world_size=world, example_inputs=(ids, labels), **layout)
    base_bytes, base_grads = _step(plain, ids, labels)
    with torch.no_grad():
        base_logits = plain(ids)
    free = make_plan(plain.program_for(ids, labels).gm, "auto", None)
    bounds = torch.tensor([free.minimum, -free.baseline], dtype=torch.float64)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)   # the largest least, the smallest baseline
    budget = int(bounds[0] - bounds[1]) // 2
    out = {"budget": budget, "baseline_measured": base_bytes}
    for mode, extra in (("full", {}), ("auto", dict(memory_budget=budget))):
        compiled = mambac.compile(model, world_size=world, remat=mode, example_inputs=(ids, labels),
                                  **layout, **extra)
        gm = compiled.program_for(ids, labels).gm
        plan = gm.meta[MEMORY_PLAN]
        nbytes, grads = _step(compiled, ids, labels)
        with torch.no_grad():
            logits = compiled(ids)
        bodies = [m.body for m in gm.modules() if isinstance(m, RematRegion)]
        out[mode] = {
            "regions": len(plan.regions), "predicted": plan.predicted, "baseline": plan.baseline,
            "measured": nbytes,
            "logits_equal": bool(torch.equal(logits, base_logits)),
            "grads_equal": sorted(grads) == sorted(base_grads) and all(torch.equal(grads[k], base_grads[k])
                                                                       for k in grads),
            "grad_max_diff": max(float((grads[k] - base_grads[k]).abs().max()) for k in grads),
            "comm_in_regions": sum(len(_forward_comms(b)) for b in bodies),
            "same_comms": _forward_comms(gm) == _forward_comms(plain.program_for(ids, labels).gm),
        }
    return out


def _model_checkpoints(world: int, **layout) -> dict:
    """A model that checkpoints its own mixers (``tests/test_capture_checkpoint.py``) on ``world``
    ranks against the same model without checkpoints, compiled alike: the recompute regions the
    checkpoints became, whether one holds a forward collective, and whether the outputs and this
    rank's gradients are the same."""
    from tests.helpers import rel_err
    from tests.test_capture_checkpoint import _Checkpointed
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(3))
    runs = []
    for how in ("module", "none"):
        compiled = mambac.compile(_Checkpointed(how=how), world_size=world, **layout)
        out = compiled(x)
        out.sum().backward()
        runs.append((compiled, out, [p.grad for p in compiled.rank_setup.model.parameters()]))
    (compiled, out, grads), (_, plain_out, plain_grads) = runs
    gm = compiled.program_for(x).gm
    plan = gm.meta[MEMORY_PLAN]
    return {"mode": plan.mode, "regions": [r.name for r in plan.regions], "out_equal": torch.equal(out, plain_out),
            "grads_equal": all(torch.equal(a, b) for a, b in zip(grads, plain_grads)),
            "grad_err": max(rel_err(a, b) for a, b in zip(grads, plain_grads)),
            "comm_in_regions": sum(communicates(n) for mod in gm.modules()
                                   if isinstance(mod, RematRegion) for n in mod.body.graph.nodes)}


def scenario_remat(world: int) -> dict:
    res = {name: _check(name, world) for name in LAYOUTS}
    res["model_checkpoints"] = {"tp2": _model_checkpoints(world, tp=world),
                                "cp2": _model_checkpoints(world, tp=1, cp=world)}
    return res
