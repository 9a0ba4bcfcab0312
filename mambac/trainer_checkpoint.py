"""The checkpoint files of ``mambac.trainer.Trainer``: what is in them, the atomic commit, resharding.

A checkpoint ``root/step_N`` is one ``torch.distributed.checkpoint`` holding

- ``model/NAME``, ``optim/NAME/exp_avg``, ``optim/NAME/exp_avg_sq``: unsharded tensors (each rank
  writes only the pieces it owns: its tp shards on dp rank 0, replicated parts once), so any tp × dp
  layout or one process reads them back and keeps its own shards; ``optim/NAME/step``;
- ``step`` (the data position: batch ``step + 1`` comes next) and ``skipped``;
- ``rng/cpu/R`` (rank R's torch CPU generator) and, where CUDA is available, ``rng/cuda/R``
  (rank R's ``torch.cuda.get_rng_state_all()``, one row per visible device).

``save`` writes into ``root/step_N.tmp``; once every rank has written, rank 0 renames it to
``root/step_N`` and replaces ``root/latest`` atomically, so a write cut short leaves only a ``.tmp``
directory and ``load(root)`` finds the last complete checkpoint.
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

from mambac.errors import MambacRuntimeError

MOMENTS = ("exp_avg", "exp_avg_sq")


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _entry(trainer, name: str, t: torch.Tensor):
    setup = getattr(trainer.compiled, "rank_setup", None)
    if setup is None or setup.plan.layout_of(name) is None:
        return t.detach()
    from mambac.runtime.checkpoint import _sharded_entry
    return _sharded_entry(name, t, setup.plan.layout_of(name), trainer.compiled.mesh)


def _cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cuda_rng_states() -> list[torch.Tensor]:
    return list(torch.cuda.get_rng_state_all())


def _set_cuda_rng_states(states: list[torch.Tensor]) -> None:
    torch.cuda.set_rng_state_all(states)


def rng_state() -> dict[str, torch.Tensor]:
    """This rank's generators: the CPU one and, where CUDA is available, every visible device's."""
    rank, _ = _rank_world()
    out = {f"rng/cpu/{rank}": torch.get_rng_state()}
    if _cuda_devices():
        out[f"rng/cuda/{rank}"] = torch.stack(_cuda_rng_states())
    return out


def trainer_state(trainer) -> dict[str, Any]:
    """This rank's part of the checkpoint (parameters and moments as unsharded entries)."""
    out: dict[str, Any] = {"step": torch.tensor(trainer.step_count), "skipped": torch.tensor(trainer.skipped)}
    out.update(rng_state())
    for name, p in trainer.params.items():
        out[f"model/{name}"] = _entry(trainer, name, p)
        st = trainer.opt.state.get(p, {})
        for m in MOMENTS:
            out[f"optim/{name}/{m}"] = _entry(trainer, name, st[m] if m in st else torch.zeros_like(p))
        out[f"optim/{name}/step"] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).reshape(())
    return out


def save(trainer, root: str) -> str:
    """Write ``root/step_N`` and point ``root/latest`` at it (collective)."""
    import torch.distributed.checkpoint as dcp
    final = os.path.join(root, f"step_{trainer.step_count}")
    tmp = final + ".tmp"
    rank0 = _rank_world()[0] == 0
    if rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    with _quiet_single_process():
        dcp.save(trainer_state(trainer), checkpoint_id=tmp)
    _fault_hook(f"after_write:{trainer.step_count}")
    _barrier()
    if rank0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _write_atomic(os.path.join(root, "latest"), json.dumps({"step": trainer.step_count,
                                                                "dir": os.path.basename(final)}))
    _barrier()
    return final


def _empty_full(trainer) -> dict[str, torch.Tensor]:
    model = getattr(trainer.compiled, "original_module", trainer.compiled)
    out: dict[str, torch.Tensor] = {"step": torch.tensor(0), "skipped": torch.tensor(0)}
    for name, p in model.named_parameters():
        if name not in trainer.params:
            continue
        out[f"model/{name}"] = torch.empty(p.shape, dtype=torch.float32)
        for m in MOMENTS:
            out[f"optim/{name}/{m}"] = torch.empty(p.shape, dtype=torch.float32)
        out[f"optim/{name}/step"] = torch.zeros((), dtype=torch.float32)
    return out


def _rng_requests(meta: dict) -> tuple[dict[str, torch.Tensor], str]:
    """The saved generators this rank restores, and a word for what they are.  With as many ranks
    as the checkpoint was written by, each rank takes its own CPU generator, and its own CUDA
    generators when they cover as many devices as are visible now; at another world size every rank
    takes rank 0's CPU generator and leaves its CUDA generators as they are (as seeded)."""
    rank, world = _rank_world()
    saved_world = sum(1 for k in meta if k.startswith("rng/cpu/"))
    if not saved_world:  # written without generator states (an older format): leave them as they are
        return {}, "none"
    same_world = saved_world == world
    cpu = f"rng/cpu/{rank if same_world else 0}"
    out = {cpu: torch.empty(tuple(meta[cpu].size), dtype=torch.uint8)}
    cuda = f"rng/cuda/{rank}"
    if same_world and cuda in meta and meta[cuda].size[0] == _cuda_devices():
        out[cuda] = torch.empty(tuple(meta[cuda].size), dtype=torch.uint8)
        return out, "cpu+cuda"
    return out, "cpu" if same_world else "cpu of rank 0"


def load(trainer, root_or_dir: str) -> int:
    """Resume from ``root/latest`` (or a ``step_N`` directory) at this trainer's layout; returns the
    restored step (collective)."""
    import torch.distributed.checkpoint as dcp
    path = latest_checkpoint(root_or_dir) or root_or_dir
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise MambacRuntimeError(f"no complete checkpoint at {root_or_dir!r} (a directory holding `latest` or a "
                                 "step_N directory written by Trainer.save).")
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    full = _empty_full(trainer)
    missing = [k for k in full if k not in meta]
    if missing:
        raise MambacRuntimeError(f"checkpoint {path!r} does not match this model: it lacks {missing[:4]}"
                                 f"{' ...' if len(missing) > 4 else ''}.")
    rng, restored = _rng_requests(meta)
    full.update(rng)
    with _quiet_single_process():
        dcp.load(full, checkpoint_id=path)
    setup = getattr(trainer.compiled, "rank_setup", None)

    def local(name: str, t: torch.Tensor) -> torch.Tensor:
        lay = None if setup is None else setup.plan.layout_of(name)
        return t if lay is None else lay.local(t)
    with torch.no_grad():
        for name, p in trainer.params.items():
            p.copy_(local(name, full[f"model/{name}"]))
            trainer.opt.state[p] = {m: local(name, full[f"optim/{name}/{m}"]).to(p).clone() for m in MOMENTS}
            trainer.opt.state[p]["step"] = full[f"optim/{name}/step"].clone()
    for key, value in rng.items():
        if key.startswith("rng/cuda/"):
            _set_cuda_rng_states(list(value))
        else:
            torch.set_rng_state(value)
    trainer.rng_restored = restored
    trainer.step_count, trainer.skipped = int(full["step"]), int(full["skipped"])
    return trainer.step_count


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
