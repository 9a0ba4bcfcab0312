"""One rank of a distributed test scenario (started by ``tests/distributed/harness.py``).

Every scenario checks many configurations in one process group (starting groups is the slow part)
and prints ``RESULT {json}``: the measured errors and collective counts, asserted by the pytest
side.  Each check compares the sharded compiled module with the single-device eager model built
from the same seed: logits, loss, every parameter's gradient (gathered to the unsharded shape) and
the unsharded state dict.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import mambac
from mambac.knobs import override as knob_override
from mambac.runtime.checkpoint import _gather_param, load_sharded, rank_plans, save_sharded
from mambac.runtime.collectives import collective_name
from tests.helpers import rel_err
from tests.models.tiny import tiny_lm

M3 = dict(layer="Mamba3", d_state=8, headdim=8, chunk_size=4)
CONFIGS = {
    "mamba1": ("mamba1", {}),
    "mamba2": ("mamba2", {}),  # ngroups=1: B/C replicated, the gated norm's group straddles ranks
    "mamba2_groups": ("mamba2", dict(ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4, ngroups=2))),
    "mamba2_groups_hdimD_nonorm_limit": ("mamba2_groups_hdimD_nonorm_limit", {}),
    "mamba2_oddheads_normbeforegate_mlp": ("mamba2_oddheads_normbeforegate_mlp", {}),
    "mamba2_dssm_side_mlp": ("mamba2_dssm_side_mlp", {}),
    "mamba2_bias": ("mamba2", dict(ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4, bias=True))),
    "mamba3_siso": ("mamba2", dict(ssm_cfg=dict(M3, ngroups=2))),
    "mamba3_mimo_norm": ("mamba2", dict(ssm_cfg=dict(M3, is_mimo=True, mimo_rank=2, is_outproj_norm=True))),
}


TWO_LAYERS = ("mamba2",)  # the others run one layer: lowering time dominates these tests


def model_for(name: str, seed: int = 0):
    base, over = CONFIGS[name]
    return tiny_lm(base, seed=seed, **dict(dict(n_layer=2 if name in TWO_LAYERS else 1), **over))


def batch(seed: int, b: int = 3, seqlen: int = 9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 37, (b, seqlen), generator=g), torch.randint(0, 37, (b, seqlen), generator=g)


def gathered_grads(compiled) -> dict[str, torch.Tensor]:
    setup, plans = compiled.rank_setup, rank_plans(compiled)
    out = {}
    for name, p in setup.model.named_parameters():
        g = p.grad
        out[name] = _gather_param(name, g, plans, compiled.mesh) if setup.plan.layout_of(name) is not None else g
    return out


def per_mixer_counts(compiled, *inputs) -> dict[str, int]:
    """Forward collectives of the lowered program whose provenance is layer 0's mixer."""
    gm = compiled.program_for(*inputs).gm
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = collective_name(node)
        path = node.meta.get("mambac_source").module_path if "mambac_source" in node.meta else ""
        if name and path.startswith("backbone.layers.0.mixer"):
            counts[name] = counts.get(name, 0) + 1
    return counts


def check_config(name: str, world: int, seqlen: int = 9, **opts) -> dict:
    model = model_for(name)
    compiled = mambac.compile(model, world_size=world, **opts)
    ids, labels = batch(7, seqlen=seqlen)
    mine = (ids, labels)
    if opts.get("cp_inputs") == "local":  # each rank passes only its piece of the sequence
        from mambac.lowering import cp_pieces
        mine, _ = cp_pieces([ids, labels], compiled.rank_setup.mesh.cp_rank, opts["cp"])
    out = {"logits": rel_err(compiled(mine[0]), model(ids))}
    loss_c, loss_e = compiled(*mine), model(ids, labels)
    out["loss"] = rel_err(loss_c, loss_e)
    loss_c.backward()
    loss_e.backward()
    ref = dict(model.named_parameters())
    got = gathered_grads(compiled)
    out["grad"] = max(rel_err(got[k], ref[k].grad) for k in got)
    sd = compiled.state_dict()
    out["state_dict"] = max(rel_err(sd[k], v) for k, v in model.state_dict().items())
    out["keys_match"] = list(sd) == list(model.state_dict())
    out["counts"] = per_mixer_counts(compiled, ids) if opts.get("cp_inputs") != "local" else {}
    return out


TP2 = ("mamba1", "mamba2", "mamba2_groups", "mamba2_oddheads_normbeforegate_mlp", "mamba2_dssm_side_mlp",
       "mamba3_mimo_norm")
TP2_SP = ("mamba1", "mamba2_groups", "mamba2_groups_hdimD_nonorm_limit", "mamba2_bias", "mamba3_siso")


BF16 = (("mamba1", dict(tp=2)), ("mamba2", dict(tp=2, sequence_parallel=True)), ("mamba2", dict(cp=2)))


def check_bf16(name: str, world: int, **opts) -> dict:
    """A bf16 copy of a float64 model, compiled with ``opts``: errors of its logits and gradients
    (gathered) against the float64 model, beside the same errors of single-process eager bf16."""
    import copy

    m64 = model_for(name).double()
    model = copy.deepcopy(m64).to(torch.bfloat16)
    compiled = mambac.compile(model, world_size=world, **opts)
    ids, labels = batch(11, seqlen=10)
    ref, out = m64(ids), compiled(ids)
    res = {"dtype": str(out.dtype), "logits": rel_err(out, ref), "logits_eager": rel_err(model(ids), ref)}
    compiled(ids, labels).backward()
    m64(ids, labels).backward()
    got, want = gathered_grads(compiled), dict(m64.named_parameters())
    res["grad"] = max(rel_err(got[k], want[k].grad) for k in got)
    model.zero_grad()
    model(ids, labels).backward()
    res["grad_eager"] = max(rel_err(p.grad, want[k].grad) for k, p in model.named_parameters())
    return res


class TorchLayersNet(torch.nn.Module):
    """A user's model: reference mixers among plain torch.nn layers (convolution over the
    sequence, LayerNorm, GELU, Dropout, GroupNorm, LogSoftmax)."""

    def __init__(self) -> None:
        super().__init__()
        from mambac.models import Mamba, Mamba2
        nn = torch.nn
        self.inp, self.conv = nn.Linear(5, 32), nn.Conv1d(32, 32, 3, padding=1)
        self.m1, self.m2 = Mamba2(32, d_state=8, headdim=8, chunk_size=4), Mamba(32, d_state=4)
        self.norm, self.act, self.drop, self.gn = nn.LayerNorm(32), nn.GELU(), nn.Dropout(0.0), nn.GroupNorm(4, 32)
        self.out, self.sm = nn.Linear(32, 6), nn.LogSoftmax(-1)

    def forward(self, x):
        h = self.conv(self.inp(x).transpose(1, 2)).transpose(1, 2)
        h = h + self.m1(h)
        h = h + self.drop(self.act(self.m2(self.norm(h))))
        return self.sm(self.out(self.gn(h.transpose(1, 2)).transpose(1, 2)))


def check_torch_layers(world: int, **opts) -> dict:
    """``TorchLayersNet`` compiled with ``opts``: output and gathered gradients against eager."""
    torch.manual_seed(0)
    model = TorchLayersNet()
    x = torch.randn(4, 12, 5, generator=torch.Generator().manual_seed(1))
    compiled = mambac.compile(model, world_size=world, example_inputs=(x,), **opts)
    ref = model(x)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    (ref * cot).sum().backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    out = compiled(x)
    (out * cot).sum().backward()
    got = gathered_grads(compiled)
    return {"logits": rel_err(out, ref), "grad": max(rel_err(got[k], want[k]) for k in want)}


def pickle_refused(world: int) -> str:
    """A module of several ranks is not pickled: the error says what to save instead."""
    import pickle

    compiled = mambac.compile(model_for("mamba1"), world_size=world)
    try:
        pickle.dumps(compiled)
    except mambac.MambacError as exc:
        return str(exc)
    return "pickled"


def scenario_tp2(world: int) -> dict:
    res = {}
    for name in TP2:
        res[name] = check_config(name, world)
    for name in TP2_SP:
        res[name + "+sp"] = check_config(name, world, sequence_parallel=True)
    res["override"] = check_config("mamba2_groups", world, plan={"backbone.layers.0.mixer": "replicate"})
    res["dp_only"] = check_config("mamba1", world, dp=world)
    res["pickle"] = pickle_refused(world)
    res["torch_layers dp"] = check_torch_layers(world, dp=world)
    res["torch_layers tp+sp"] = check_torch_layers(world, tp=world, sequence_parallel=True)
    for name, opts in BF16:
        res[f"bf16 {name} {sorted(opts.items())}"] = check_bf16(name, world, **opts)
    res.update(sharded_output(world), wrong_world=wrong_world_size(world), reload=reload_weights(world))
    return res


def sharded_output(world: int) -> dict:
    model = model_for("mamba2")
    compiled = mambac.compile(model, world_size=world, output="sharded")
    ids, _ = batch(3)
    local = compiled(ids)
    full = model(ids)
    r, v = dist.get_rank(), full.shape[-1]
    start = sum(v // world + (1 if i < v % world else 0) for i in range(r))
    return {"sharded_output": rel_err(local, full[..., start:start + local.shape[-1]]),
            "sharded_width": local.shape[-1]}


def wrong_world_size(world: int) -> str:
    try:
        mambac.compile(model_for("mamba1"), world_size=world * 2)
    except mambac.MambacRuntimeError as exc:
        return str(exc)
    return ""


def reload_weights(world: int) -> float:
    """An unsharded state dict loaded into the sharded module gives the eager model's logits."""
    model, other = model_for("mamba2_groups", seed=0), model_for("mamba2_groups", seed=5)
    compiled = mambac.compile(model, world_size=world)
    compiled.load_state_dict(other.state_dict())
    ids, _ = batch(11)
    return rel_err(compiled(ids), other(ids))


def scenario_w4(world: int) -> dict:
    res = {"oddheads_tp4": check_config("mamba2_oddheads_normbeforegate_mlp", world),
           "mamba1_tp4_sp": check_config("mamba1", world, sequence_parallel=True),
           "mamba2_dp2_tp2_sp": check_config("mamba2_groups", world, dp=2, tp=2, sequence_parallel=True)}
    res["reshard"] = reshard(world)
    res["training"] = training(world)
    return res


def reshard(world: int) -> float:
    """Save at tp=4, load at dp=2 x tp=2: the unsharded state dict survives exactly."""
    model = model_for("mamba2_groups", seed=1)
    path = os.path.join(os.environ["MAMBAC_TEST_TMP"], "ckpt")
    save_sharded(mambac.compile(model, world_size=world, tp=4), path)
    dist.barrier()
    fresh = mambac.compile(model_for("mamba2_groups", seed=9), world_size=world, dp=2, tp=2)
    load_sharded(fresh, path)
    sd = fresh.state_dict()
    return max(rel_err(sd[k], v) for k, v in model.state_dict().items())


def training(world: int) -> dict:
    """Three AdamW steps with gradient clipping at dp=2 x tp=2 equal three single-device steps."""
    eager, base = model_for("mamba2", seed=3), model_for("mamba2", seed=3)
    compiled = mambac.compile(base, world_size=world, dp=2, tp=2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2, weight_decay=0.1)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(3):
        ids, labels = batch(100 + step, b=4)
        for m, opt in ((eager, opt_e), (compiled, opt_c)):
            opt.zero_grad()
            m(ids, labels).backward()
            norms.append(float(mambac.clip_grad_norm_(m, 0.5)))
            opt.step()
    sd = compiled.state_dict()
    return {"params": max(rel_err(sd[k], v) for k, v in eager.state_dict().items()), "norm_values": norms,
            "norms": [abs(a - b) / b for a, b in zip(norms[::2], norms[1::2])]}


def scenario_mismatch(world: int) -> dict:
    """Rank 0 compiles tp=2, rank 1 cp=2: both must refuse at compile time with the same error."""
    opts = dict(tp=2) if dist.get_rank() == 0 else dict(cp=2)
    try:
        mambac.compile(model_for("mamba1"), world_size=world, **opts)
        return {"error": ""}
    except mambac.MambacRuntimeError as exc:
        return {"error": str(exc)}


def scenario_faults(world: int) -> dict:
    """Debug-mode input check; then rank 1 stops calling (rank 0 must time out with a clear error)
    and dies (rank 0's next call must fail with a clear error), never a hang."""
    res = {}
    compiled = mambac.compile(model_for("mamba1"), world_size=world)
    ids, _ = batch(1)
    mine = ids if dist.get_rank() == 0 else ids + 1
    try:
        compiled(mine)
        res["debug"] = ""
    except mambac.MambacInputError as exc:
        res["debug"] = str(exc)
    if dist.get_rank() == 1:
        print("RESULT " + json.dumps(res), flush=True)
        time.sleep(float(os.environ["MAMBAC_TEST_PG_TIMEOUT"]) + 2)
        os._exit(0)  # this rank dies without telling the others
    for key in ("hung_peer", "dead_peer"):
        t0 = time.monotonic()
        try:
            with knob_override(debug=False):
                compiled(ids)
            res[key] = ""
        except mambac.MambacRuntimeError as exc:
            res[key] = str(exc)
        res[key + "_s"] = time.monotonic() - t0
        time.sleep(3 if key == "hung_peer" else 0)  # rank 1 exits meanwhile
    return res


def main() -> None:
    scenario = sys.argv[1]
    torch.set_num_threads(1)
    import datetime
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(os.environ.get("MAMBAC_TEST_PG_TIMEOUT", "60"))))
    world = dist.get_world_size()
    from tests.distributed.cp_lm_worker import scenario_cp_lm, scenario_cp_lm_kernels
    from tests.distributed.cp_worker import scenario_cp
    from tests.distributed.remat_worker import scenario_remat
    scenarios = {"tp2": scenario_tp2, "w4": scenario_w4, "faults": scenario_faults, "cp": scenario_cp, "cp_lm": scenario_cp_lm,
                 "cp_lm_kernels": scenario_cp_lm_kernels, "mismatch": scenario_mismatch,
                 "remat": scenario_remat}
    result = scenarios[scenario](world)
    print("RESULT " + json.dumps(result), flush=True)
    if scenario != "faults":
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("MAMBAC_TEST_TMP", tempfile.gettempdir())
    main()
