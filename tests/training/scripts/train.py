"""Train a tiny LM with ``mambac.trainer.Trainer`` (one process, or a rank under ``mambac run``).

usage: train.py ROOT LOG --steps N [--tp T] [--dp D] [--resume] [--kill-rank R --kill-step K]
Every completed step is checkpointed under ROOT and appended to LOG (rank 0) as
``{"step", "loss", "batch"}`` (``batch``: a fingerprint of the token ids that step trained on).
With ``--kill-step``, rank R SIGKILLs itself at the start of that step on the first attempt only
(torchrun's TORCHELASTIC_RESTART_COUNT is 0), to test restarts.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository (for tests.*)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mambac  # noqa: E402
from mambac.trainer import SyntheticTokens, Trainer, init_restartable_process_group, latest_checkpoint  # noqa: E402
from tests.models.tiny import tiny_lm  # noqa: E402


def make_trainer(tp: int, dp: int, cp: int = 1) -> Trainer:
    torch.manual_seed(0)
    model = tiny_lm("mamba2", n_layer=1)
    world = tp * dp * cp
    if world > 1:
        init_restartable_process_group(timeout_s=30)
    # lowered now for the training signature (ids, labels); other batch sizes reuse the program
    example = SyntheticTokens(vocab=37, batch=2, seqlen=8).batch_at(0)
    compiled = mambac.compile(model, world_size=world, tp=tp, dp=dp, cp=cp, comm_timeout=30,
                              example_inputs=example) \
        if world > 1 else mambac.compile(model, example_inputs=example)
    return Trainer(compiled, lr=3e-3, max_grad_norm=0.5, accum=2)


def fingerprint(ids: torch.Tensor) -> int:
    """An order-sensitive checksum of a batch of token ids."""
    return int((ids.reshape(-1) * torch.arange(1, ids.numel() + 1)).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("log")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    a = ap.parse_args()
    trainer = make_trainer(a.tp, a.dp)
    if a.resume or latest_checkpoint(a.root):
        trainer.load(a.root)
    rank = dist.get_rank() if dist.is_initialized() else 0
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    data = SyntheticTokens(vocab=37, batch=4, seqlen=8)
    while trainer.step_count < a.steps:
        nxt = trainer.step_count + 1
        if nxt == a.kill_step and rank == a.kill_rank and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
        ids, labels = data.batch_at(nxt)
        loss = trainer.step(ids, labels)
        trainer.save(a.root)
        if rank == 0:
            with open(a.log, "a") as f:
                f.write(json.dumps({"step": trainer.step_count, "loss": loss, "batch": fingerprint(ids)}) + "\n")
        if dist.is_initialized():
            dist.barrier()  # the step is logged before any rank can move on (and die)


if __name__ == "__main__":
    main()
