"""One rank of a multi-process trainer scenario (started by ``tests/training/ranks.py``).

``dp2`` (2 ranks): tp=1 × dp=2 training with an uneven data-parallel split (micro-batches of 3
rows), a checkpoint after step 2 and a same-layout resume.  ``w4`` (4 ranks): tp=4 training with a
checkpoint after step 2; then tp=2 × dp=2 training from scratch, and the same trainer resumed from the
tp=4 checkpoint; then the same at tp=2 × cp=2 (context parallelism).  Before each save every rank seeds its CPU generator differently and records what
it draws next, so the test can tell which generator a resume restored.  The rank prints
``RESULT {json}`` with losses, gradient norms and draws; the pytest side compares them.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from mambac.trainer import SyntheticTokens
from tests.training.scripts.train import make_trainer

DP2_DATA = SyntheticTokens(vocab=37, batch=6, seqlen=8)  # accum=2 -> 3 rows over dp=2: 2 + 1
W4_DATA = SyntheticTokens(vocab=37, batch=4, seqlen=8)


def train(trainer, data, last: int, root: str | None = None, save_at: int = -1) -> dict:
    """Steps up to ``last``: losses and gradient norms, and the draws after the checkpoint."""
    out: dict = {"loss": {}, "norm": {}}
    while trainer.step_count < last:
        s = trainer.step_count + 1
        out["loss"][s] = trainer.step(*data.batch_at(s))
        out["norm"][s] = trainer.grad_norm
        if s == save_at:
            torch.manual_seed(100 + dist.get_rank())
            trainer.save(root)
            out["draws"] = torch.rand(3).tolist()
    return out


def resume(trainer, data, root: str, last: int) -> dict:
    torch.manual_seed(12345)  # what a fresh process would have; the checkpoint's generator replaces it
    step = trainer.load(root)
    draws = torch.rand(3).tolist()
    out = train(trainer, data, last)
    out.update(loaded=step, draws=draws, rng=trainer.rng_restored)
    return out


def replicas_agree(trainer) -> bool:
    """Every dp replica holds the same parameters: a checksum of this rank's shards equals the one
    of the same tp rank in every other replica (ranks are dp-major)."""
    flat = torch.cat([p.detach().reshape(-1) for p in trainer.params.values()]).double()
    mine = torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum(),
                        torch.tensor(float(flat.numel()), dtype=torch.float64)])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    tp = trainer.compiled.options.tp
    return all(torch.equal(everyone[r], mine) for r in range(dist.get_rank() % tp, len(everyone), tp))


def scenario_dp2(tmp: str) -> dict:
    root = os.path.join(tmp, "dp2")
    trainer = make_trainer(1, 2)
    res = {"run": train(trainer, DP2_DATA, 3, root, save_at=2), "replicas_agree": replicas_agree(trainer)}
    fresh = make_trainer(1, 2)
    fresh.step(*DP2_DATA.batch_at(9))  # weights and moments that the load must overwrite
    res["resumed"] = resume(fresh, DP2_DATA, root, 3)
    return res


def scenario_w4(tmp: str) -> dict:
    root = os.path.join(tmp, "tp4")
    res = {"tp4": train(make_trainer(4, 1), W4_DATA, 4, root, save_at=2)}
    t22 = make_trainer(2, 2)
    res["tp2dp2"] = train(t22, W4_DATA, 3)
    res["replicas_agree"] = replicas_agree(t22)
    res["resumed"] = resume(t22, W4_DATA, root, 4)  # the step-3 trainer goes back to the tp=4 step 2
    tcp = make_trainer(2, 1, cp=2)                   # tp=2 x cp=2: the sequence split in two
    res["tp2cp2"] = train(tcp, W4_DATA, 3)
    res["cp_resumed"] = resume(tcp, W4_DATA, root, 4)
    return res


def main() -> None:
    scenario, tmp = sys.argv[1], sys.argv[2]
    result = {"dp2": scenario_dp2, "w4": scenario_w4}[scenario](tmp)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
