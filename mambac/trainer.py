"""A training step and resumable checkpoints around a compiled module.

``Trainer(compiled, lr=...)`` owns an AdamW optimiser over the module's (fp32, possibly sharded)
parameters.  ``trainer.step(ids, labels)`` validates the batch before any collective, runs
``accum`` micro-batches (bf16 autocast on CUDA when asked; the parameters stay fp32), checks the
loss and every gradient for NaN/Inf (skip the step, or stop naming the step and parameter), clips
the global gradient norm across shards and steps the optimiser.

``trainer.save(root)`` writes a ``torch.distributed.checkpoint`` of the parameters and the AdamW
moments (both as *unsharded* tensors, so any tp/dp layout or one process can load them), the step
counter and the RNG state into ``root/step_N.tmp``; once every rank has written, rank 0 renames it to
``root/step_N`` and replaces ``root/latest`` atomically.  A write cut short leaves only a ``.tmp``
directory, so ``trainer.load(root)`` always finds the last complete checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist

from mambac.errors import MambacInputError, MambacRuntimeError
from mambac.training import clip_grad_norm_

_MOMENTS = ("exp_avg", "exp_avg_sq")


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


class Trainer:
    """AdamW training of a compiled module (one rank's view; every rank makes the same calls)."""

    def __init__(self, compiled: torch.nn.Module, lr: float = 1e-3, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), max_grad_norm: float | None = 1.0, accum: int = 1,
                 bf16: bool | None = None, on_nonfinite: str = "raise") -> None:
        if on_nonfinite not in ("raise", "skip"):
            raise MambacInputError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}.")
        if accum < 1:
            raise MambacInputError(f"accum must be a positive number of micro-batches, got {accum}.")
        self.compiled, self.accum, self.max_grad_norm, self.on_nonfinite = compiled, accum, max_grad_norm, on_nonfinite
        self.params = dict(self._named_params())
        device = next(iter(self.params.values())).device
        self.bf16 = device.type == "cuda" if bf16 is None else bf16
        self.device_type = device.type
        self.opt = torch.optim.AdamW(list(self.params.values()), lr=lr, betas=betas, weight_decay=weight_decay)
        self.step_count, self.skipped = 0, 0
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
        for what, t in (("ids", ids), ("labels", labels)):
            if not isinstance(t, torch.Tensor):
                raise MambacInputError(f"{what} must be a tensor, got {type(t).__name__}.")
            if t.dtype not in (torch.int64, torch.int32):
                raise MambacInputError(f"{what} must hold integer token ids (int64), got {t.dtype}.")
            if t.dim() != 2:
                raise MambacInputError(f"{what} must be (batch, seqlen), got shape {tuple(t.shape)}.")
        if ids.shape != labels.shape:
            raise MambacInputError(f"ids {tuple(ids.shape)} and labels {tuple(labels.shape)} differ in shape.")
        if self.vocab is not None and ids.numel():
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.vocab:
                raise MambacInputError(f"token ids must lie in [0, {self.vocab}); this batch has {lo}..{hi}.")
        dp = self._layout()[1]
        if ids.shape[0] % (self.accum * dp):
            raise MambacInputError(f"batch size {ids.shape[0]} does not split into accum={self.accum} micro-batches "
                                   f"of dp={dp} equal parts (needs a multiple of {self.accum * dp}).")

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimiser step over ``accum`` micro-batches; returns the mean loss (every rank)."""
        self.check_batch(ids, labels)
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for mid, mlab in zip(ids.chunk(self.accum), labels.chunk(self.accum)):
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
            clip_grad_norm_(self.compiled, self.max_grad_norm)
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

    def _entry(self, name: str, t: torch.Tensor):
        setup = getattr(self.compiled, "rank_setup", None)
        if setup is None or setup.plan.layout_of(name) is None:
            return t.detach()
        from mambac.runtime.checkpoint import _sharded_entry
        return _sharded_entry(name, t, setup.plan.layout_of(name), self.compiled.mesh)

    def state(self) -> dict[str, Any]:
        """This rank's part of the checkpoint: parameters and moments as unsharded entries."""
        out: dict[str, Any] = {"rng": torch.get_rng_state(), "step": torch.tensor(self.step_count),
                               "skipped": torch.tensor(self.skipped)}
        for name, p in self.params.items():
            out[f"model/{name}"] = self._entry(name, p)
            st = self.opt.state.get(p, {})
            for m in _MOMENTS:
                out[f"optim/{name}/{m}"] = self._entry(name, st[m] if m in st else torch.zeros_like(p))
            out[f"optim/{name}/step"] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).reshape(())
        return out

    def save(self, root: str) -> str:
        """Write checkpoint ``root/step_N`` and point ``root/latest`` at it (collective)."""
        import torch.distributed.checkpoint as dcp
        final = os.path.join(root, f"step_{self.step_count}")
        tmp = final + ".tmp"
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        _barrier()
        with _quiet_single_process():
            dcp.save(self.state(), checkpoint_id=tmp)
        _fault_hook(f"after_write:{self.step_count}")
        _barrier()
        if rank0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_atomic(os.path.join(root, "latest"), json.dumps({"step": self.step_count, "dir": os.path.basename(final)}))
        _barrier()
        return final

    def load(self, root_or_dir: str) -> int:
        """Resume from ``root/latest`` (or a ``step_N`` directory); returns the restored step."""
        import torch.distributed.checkpoint as dcp
        path = latest_checkpoint(root_or_dir) or root_or_dir
        if not os.path.exists(os.path.join(path, ".metadata")):
            raise MambacRuntimeError(f"no complete checkpoint at {root_or_dir!r}.")
        full = self._empty_full()
        with _quiet_single_process():
            dcp.load(full, checkpoint_id=path)
        setup = getattr(self.compiled, "rank_setup", None)

        def local(name: str, t: torch.Tensor) -> torch.Tensor:
            lay = None if setup is None else setup.plan.layout_of(name)
            return t if lay is None else lay.local(t)
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(local(name, full[f"model/{name}"]))
                self.opt.state[p] = {m: local(name, full[f"optim/{name}/{m}"]).to(p).clone() for m in _MOMENTS}
                self.opt.state[p]["step"] = full[f"optim/{name}/step"].clone()
        torch.set_rng_state(full["rng"])
        self.step_count, self.skipped = int(full["step"]), int(full["skipped"])
        return self.step_count

    def _empty_full(self) -> dict[str, torch.Tensor]:
        model = getattr(self.compiled, "original_module", self.compiled)
        shapes = {n: p for n, p in model.named_parameters() if n in self.params}
        out: dict[str, torch.Tensor] = {"rng": torch.get_rng_state(), "step": torch.tensor(0),
                                        "skipped": torch.tensor(0)}
        for name, p in shapes.items():
            out[f"model/{name}"] = torch.empty(p.shape, dtype=torch.float32)
            for m in _MOMENTS:
                out[f"optim/{name}/{m}"] = torch.empty(p.shape, dtype=torch.float32)
            out[f"optim/{name}/step"] = torch.zeros((), dtype=torch.float32)
        return out


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


def latest_checkpoint(root: str) -> str | None:
    """The directory ``root/latest`` points at, or None when there is no complete checkpoint."""
    pointer = os.path.join(root, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return os.path.join(root, json.load(f)["dir"])


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process():
    """Silence torch.distributed.checkpoint's warning that it runs without a process group."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fault_hook(point: str) -> None:
    """Test hook: ``MAMBAC_TEST_KILL_AT=after_write:N`` SIGKILLs this process once the files of
    checkpoint N are written but before it is committed (a crash mid-checkpoint)."""
    if os.environ.get("MAMBAC_TEST_KILL_AT") == point:
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
