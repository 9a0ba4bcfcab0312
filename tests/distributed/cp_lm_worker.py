"""Context parallelism through ``mambac.compile``: whole LMs on 2 or 4 gloo ranks (``worker.py cp_lm``).

Each configuration compiles a tiny LM of one family with ``cp`` (alone, or with tp or dp) and compares
logits, loss, every parameter's gradient (gathered to the unsharded shape, summed over the replicas)
and the unsharded state dict with the single-process eager model, at lengths that are and are not
multiples of cp x chunk; one more measures the activations autograd saves per rank at a long length.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor
import torch.distributed as dist

import mambac
from tests.distributed.worker import batch, check_config, gathered_grads, model_for
from tests.helpers import rel_err

# name -> (model config name of worker.CONFIGS, compile options, sequence lengths)
WORLD2 = {
    "mamba1": ("mamba1", dict(cp=2), (9, 16)),
    "mamba2": ("mamba2", dict(cp=2), (9, 16)),
    "mamba3_siso": ("mamba3_siso", dict(cp=2), (9, 16)),
    "mamba3_mimo_norm": ("mamba3_mimo_norm", dict(cp=2), (7, 16)),
    "mamba2_oddheads_mlp": ("mamba2_oddheads_normbeforegate_mlp", dict(cp=2), (11,)),
    "mamba2_local_inputs": ("mamba2", dict(cp=2, cp_inputs="local"), (9,)),
    "mamba1_local_inputs": ("mamba1", dict(cp=2, cp_inputs="local"), (10,)),
    "mamba3_mimo_local_inputs": ("mamba3_mimo_norm", dict(cp=2, cp_inputs="local"), (9,)),
    "mamba2_remat_full": ("mamba2", dict(cp=2, remat="full"), (9,)),
}
WORLD4 = {
    "cp4_mamba1": ("mamba1", dict(cp=4), (9,)),
    "cp4_mamba2": ("mamba2", dict(cp=4), (6, 16)),
    "cp4_mamba3_mimo": ("mamba3_mimo_norm", dict(cp=4), (10,)),
    "tp2xcp2_mamba2": ("mamba2_groups", dict(tp=2, cp=2), (9, 16)),
    "tp2xcp2_mamba3": ("mamba3_siso", dict(tp=2, cp=2), (9,)),
    "tp2xcp2_mamba3_mimo": ("mamba3_mimo_norm", dict(tp=2, cp=2), (8,)),
    "tp2xcp2_mamba1": ("mamba1", dict(tp=2, cp=2), (8,)),
    "tp2xcp2_mamba1_sp": ("mamba1", dict(tp=2, cp=2, sequence_parallel=True), (11,)),
    "dp2xcp2_mamba2": ("mamba2", dict(dp=2, cp=2), (9,)),
    "dp2xcp2_mamba1": ("mamba1", dict(dp=2, cp=2), (9,)),
    "dp2xcp2_mamba3": ("mamba3_siso", dict(dp=2, cp=2), (10,)),
}
# the generated kernels under Triton's interpreter (the test sets TRITON_INTERPRET=1): cp_ssd runs
# its fused form, the exchange inside one autograd Function
KERNELS2 = {"mamba2_kernels": ("mamba2", dict(cp=2, kernels="triton"), (9,))}
KERNELS4 = {"tp2xcp2_mamba2_kernels": ("mamba2_groups", dict(tp=2, cp=2, kernels="triton"), (11,))}


def sharded_output(world: int) -> float:
    """output='sharded': each rank returns the logits of its own piece of the sequence."""
    model = model_for("mamba2")
    compiled = mambac.compile(model, world_size=world, cp=world, output="sharded")
    ids, _ = batch(7, seqlen=11)
    from mambac.lowering import cp_pieces
    (want,), _ = cp_pieces([model(ids)], compiled.rank_setup.mesh.cp_rank, world)
    got = compiled(ids)
    return rel_err(got, want) if got.shape == want.shape else float("inf")


def saved_bytes(module, *inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward during one forward."""
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(seen.values())


def long_sequence(world: int, seqlen: int = 8192) -> dict:
    """Saved activations per rank at a long sequence, against the single-process figure; the loss
    and every parameter's gradient against single-process eager."""
    from tests.models.tiny import tiny_lm
    model = tiny_lm("mamba2", seed=3, n_layer=1, d_model=16,
                    ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=64))
    ids, labels = batch(5, b=1, seqlen=seqlen)
    compiled = mambac.compile(model, world_size=world, cp=world)
    mine = saved_bytes(compiled, ids, labels)
    whole = saved_bytes(model, ids, labels)
    loss_c, loss_e = compiled(ids, labels), model(ids, labels)
    loss_c.backward()
    loss_e.backward()
    ref = dict(model.named_parameters())
    grads = gathered_grads(compiled)
    return {"rank_bytes": mine, "single_bytes": whole, "loss": rel_err(loss_c, loss_e),
            "grad": max(rel_err(g, ref[k].grad) for k, g in grads.items())}


def _run(table: dict, world: int) -> dict:
    res = {}
    for name, (config, opts, lengths) in table.items():
        for L in lengths:
            res[f"{name}@{L}"] = check_config(config, world, seqlen=L, **opts)
    return res


def scenario_cp_lm_kernels(world: int) -> dict:
    """The KERNELS tables, counting the calls of the fused cp SSD (it must be the form that ran)."""
    import mambac.runtime.cp_ssd_fused as fused
    plain, calls = fused.cp_ssd_fused, []

    def counted(*args, **kwargs):
        calls.append(1)
        return plain(*args, **kwargs)

    fused.cp_ssd_fused = counted
    res = _run(KERNELS2 if world == 2 else KERNELS4, world)
    res["fused_calls"] = len(calls)
    res["rank"] = dist.get_rank()
    return res


def scenario_cp_lm(world: int) -> dict:
    res = _run(WORLD2 if world == 2 else WORLD4, world)
    res["long"] = long_sequence(world)
    if world == 2:
        res["sharded_output"] = sharded_output(world)
    res["rank"] = dist.get_rank()
    return res
