"""A training step and resumable checkpoints around a compiled module.

``Trainer(compiled, lr=...)`` owns an AdamW optimiser over the module's (fp32, possibly sharded)
parameters.  ``trainer.step(ids, labels)`` validates the batch before any collective, runs
``accum`` micro-batches (bf16 autocast on CUDA when asked; the parameters stay fp32), checks the
loss and every gradient for NaN/Inf (skip the step, or stop naming the step and parameter), clips
the global gradient norm across shards and steps the optimiser.

``trainer.save(root)`` / ``trainer.load(root)`` write and read resumable checkpoints (parameters and
AdamW moments stored unsharded, so any tp × dp layout or one process resumes them; the step counter,
which is the data position; every rank's RNG state), committed atomically: see
``mambac.trainer_checkpoint``.
"""
from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import torch
import torch.distributed as dist

from mambac.errors import MambacInputError, MambacRuntimeError
from mambac.models.lm import check_token_batch
from mambac.trainer_checkpoint import latest_checkpoint  # noqa: F401  (part of this module's interface)
from mambac.training import clip_grad_norm_


class SyntheticTokens:
    """A resumable synthetic token source: batch ``k`` depends only on ``(seed, k)``, so the data
    position is just the step counter saved in the checkpoint."""

    def __init__(self, vocab: int, batch: int, seqlen: int, seed: int = 0) -> None:
        self.vocab, self.batch, self.seqlen, self.seed = vocab, batch, seqlen, seed

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and next-token labels of step ``step`` (a copy-the-shifted-sequence task)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seq = torch.randint(0, self.vocab, (self.batch, self.seqlen + 1), generator=g)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _vocab_size(model: torch.nn.Module) -> int | None:
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "vocab_size", None):
        return int(cfg.vocab_size)
    emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if emb is None else emb.num_embeddings


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_settings(lr, weight_decay, betas, max_grad_norm, accum, bf16, on_nonfinite) -> None:
    """Every setting of ``Trainer`` checked at once, before the optimizer exists."""
    if on_nonfinite not in ("raise", "skip"):
        raise MambacInputError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}.")
    if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
        raise MambacInputError(f"accum must be a positive number of micro-batches, got {accum!r}.")
    if not _number(lr) or lr <= 0:
        raise MambacInputError(f"lr must be a positive number, got {lr!r}.")
    if not _number(weight_decay) or weight_decay < 0:
        raise MambacInputError(f"weight_decay must be a number >= 0, got {weight_decay!r}.")
    if (not isinstance(betas, (tuple, list)) or len(betas) != 2
            or not all(_number(b) and 0 <= b < 1 for b in betas)):
        raise MambacInputError(f"betas must be two numbers in [0, 1), e.g. (0.9, 0.95), got {betas!r}.")
    if max_grad_norm is not None and (not _number(max_grad_norm) or max_grad_norm <= 0):
        raise MambacInputError(f"max_grad_norm must be a positive number, or None for no clipping, "
                               f"got {max_grad_norm!r}.")
    if bf16 is not None and not isinstance(bf16, bool):
        raise MambacInputError(f"bf16 must be True, False or None (on for CUDA), got {bf16!r}.")


class Trainer:
    """AdamW training of a compiled module (one rank's view; every rank makes the same calls)."""

    def __init__(self, compiled: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float | None = 1.0, accum: int = 1,
                 bf16: bool | None = None, on_nonfinite: str = "raise") -> None:
        _check_settings(lr, weight_decay, betas, max_grad_norm, accum, bf16, on_nonfinite)
        self.compiled, self.accum, self.max_grad_norm, self.on_nonfinite = compiled, accum, max_grad_norm, on_nonfinite
        self.params = dict(self._named_params())
        device = next(iter(self.params.values())).device
        self.bf16 = device.type == "cuda" if bf16 is None else bf16
        self.device_type = device.type
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=lr, betas=betas, weight_decay=weight_decay)
        self.step_count, self.skipped = 0, 0
        self.grad_norm: float | None = None  # the last step's unsharded gradient norm (before clipping)
        self.rng_restored: str | None = None  # which generators the last load restored (trainer_checkpoint)
        self.vocab = _vocab_size(getattr(compiled, "original_module", compiled))

    def _named_params(self):
        setup = getattr(self.compiled, "rank_setup", None)
        model = setup.model if setup is not None else self.compiled
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    # ---- the step ------------------------------------------------------------------------

    def _layout(self) -> tuple[int, int]:
        opts = getattr(self.compiled, "options", None)
        return (1, 1) if opts is None or opts.world_size == 1 else (opts.tp, opts.dp)

    def check_batch(self, ids: Any, labels: Any) -> None:
        """Raise ``MambacInputError`` for a batch this trainer/layout cannot take (no collective)."""
        check_token_batch(ids, labels, self.vocab)
        opts = getattr(self.compiled, "options", None)
        if opts is not None and opts.cp > 1 and opts.cp_inputs == "full" and ids.shape[1] < opts.cp:
            raise MambacInputError(f"a sequence of {ids.shape[1]} tokens cannot be split over cp={opts.cp} "
                                   f"context-parallel ranks; pass at least {opts.cp} tokens per sequence.")
        dp = self._layout()[1]
        b = ids.shape[0]
        if b % self.accum:
            raise MambacInputError(f"batch size {b} does not split into accum={self.accum} equal micro-batches "
                                   f"(needs a multiple of {self.accum}).")
        if b // self.accum < dp:
            raise MambacInputError(f"a micro-batch of {b // self.accum} rows (batch {b} / accum={self.accum}) leaves "
                                   f"some of the dp={dp} data-parallel ranks without a row; pass a batch of at "
                                   f"least {self.accum * dp} rows.")

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimiser step over ``accum`` micro-batches; returns the mean loss (every rank)."""
        self.check_batch(ids, labels)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        ddp = getattr(self.compiled, "__dict__", {}).get("_mambac_ddp")
        for i, (mid, mlab) in enumerate(zip(ids.chunk(self.accum), labels.chunk(self.accum))):
            # dp: gradients are summed over the replicas once, on the last micro-batch
            last = ddp is None or i == self.accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
                    loss = self.compiled(mid, mlab)
                (loss.float() / self.accum).backward()
            total += float(loss.detach().float()) / self.accum
        self.step_count += 1
        bad = self._first_nonfinite(total)
        if bad is not None:
            if self.on_nonfinite == "raise":
                raise MambacRuntimeError(f"step {self.step_count}: non-finite {bad}; stopping (on_nonfinite='skip' "
                                         "would drop such steps).")
            self.opt.zero_grad(set_to_none=True)
            self.skipped += 1
            return total
        if self.max_grad_norm is not None:
            self.grad_norm = float(clip_grad_norm_(self.compiled, self.max_grad_norm))
        self.opt.step()
        return total

    def _first_nonfinite(self, loss: float) -> str | None:
        """Name the first non-finite thing of this step, agreed on by every rank (one all-reduce)."""
        mine = None if torch.isfinite(torch.tensor(loss)) else "loss"
        if mine is None:
            mine = next((f"gradient of '{n}'" for n, p in self.params.items()
                         if p.grad is not None and not torch.isfinite(p.grad).all()), None)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        device = next(iter(self.params.values())).device  # NCCL reduces device tensors only
        flag = torch.tensor([0.0 if mine is None else 1.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() == 0:
            return None
        return mine or "gradient on another rank"

    # ---- checkpoints ---------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """This rank's part of the checkpoint: parameters and moments as unsharded entries."""
        from mambac.trainer_checkpoint import trainer_state
        return trainer_state(self)

    def save(self, root: str) -> str:
        """Write checkpoint ``root/step_N`` and point ``root/latest`` at it (collective)."""
        from mambac.trainer_checkpoint import save
        return save(self, root)

    def load(self, root_or_dir: str) -> int:
        """Resume from ``root/latest`` (or a ``step_N`` directory) at this trainer's layout, whatever
        layout wrote it; returns the restored step (collective)."""
        from mambac.trainer_checkpoint import load
        return load(self, root_or_dir)


def init_restartable_process_group(timeout_s: float = 60.0, backend: str = "gloo") -> None:
    """Initialise the default process group so that a ``--max-restarts`` restart can rendezvous.

    torchrun keeps one key-value store across restarts; the rendezvous keys the failed attempt
    wrote (the peers' old addresses) are still in it, and a plain ``init_process_group`` of the
    next attempt can read them and fail to connect.  This joins through a per-attempt prefix
    (``TORCHELASTIC_RESTART_COUNT``).  Call it before ``mambac.compile`` (which then uses this group);
    outside torchrun it does nothing."""
    import datetime
    if dist.is_initialized() or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return
    timeout = datetime.timedelta(seconds=float(timeout_s))
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timeout)
    store = dist.PrefixStore(f"mambac_attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", base)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
