"""Process groups and the device mesh (dp x cp x tp) a compiled module runs on.

mambac uses ``torch.distributed`` as it is: the process group is the one the launcher
(``torchrun`` or ``mambac run``) set up, or one mambac initialises from the launcher's environment
(gloo on CPU, NCCL on GPU) with the requested timeout.  Ranks are laid out dp-major, then cp, then
tp: rank = (dp_rank * cp + cp_rank) * tp + tp_rank, so the tp ranks of one sequence piece are
consecutive (``torch.distributed.device_mesh.init_device_mesh`` over (dp, cp, tp)).  Parameter
gradients are summed over the *replica* group: the ranks that hold the same tp shard (dp x cp).
"""
from __future__ import annotations

import atexit
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mambac.errors import MambacRuntimeError
from mambac.ir import MeshSpec


def launch_hint(world_size: int) -> str:
    return (f"launch {world_size} processes, e.g. `mambac run -n {world_size} script.py` or "
            f"`torchrun --nproc-per-node {world_size} script.py`, and call mambac.compile(model, "
            f"world_size={world_size}, ...) in each")


def backend_for_device(device_type: str | None = None) -> str:
    """NCCL for a model on CUDA, gloo for one on the CPU; with no model at hand, NCCL where CUDA is."""
    if device_type is not None:
        return "nccl" if device_type == "cuda" else "gloo"
    return "nccl" if torch.cuda.is_available() else "gloo"


def launched() -> bool:
    """True inside a process started by torchrun / ``mambac run`` (its environment is set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_distributed(timeout_s: float | None = None, backend: str | None = None) -> None:
    """Initialise the default process group from the launcher's environment (no-op when done)."""
    if dist.is_initialized():
        return
    if not launched():
        raise MambacRuntimeError("no process group and no launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                                 "MASTER_PORT); " + launch_hint(int(os.environ.get("WORLD_SIZE", "2"))) + ".")
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=float(timeout_s))}
    backend = backend or backend_for_device()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, **kw)
    atexit.register(_shut_down)  # the group mambac made is mambac's to close: no backend threads left at exit


EXIT_WAIT_S = 15.0  # how long a rank waits at exit for the others before closing the group anyway


def _shut_down() -> None:
    """Close the process group at interpreter exit.  A live gloo/NCCL group can abort the process
    as its threads are torn down, and so can one rank closing its connections while another still
    uses them; so the ranks first meet at the group's store (at most ``EXIT_WAIT_S``: a rank that
    died or left early must not turn exit into a hang), then each closes its group."""
    try:
        if not dist.is_initialized():
            return
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"mambac/exit/{dist.get_rank()}", "1")
            store.wait([f"mambac/exit/{r}" for r in range(dist.get_world_size())],
                       datetime.timedelta(seconds=EXIT_WAIT_S))
        except Exception:  # a peer gone, or the store's host left first: close anyway
            pass
        dist.destroy_process_group()
    except Exception:  # exiting anyway; a peer that already left must not turn exit into a crash
        pass


@dataclass
class RankMesh:
    """This process's place in the mesh and its process groups."""

    spec: MeshSpec
    rank: int
    tp_group: object
    dp_group: object
    device_mesh: object
    cp_group: object = None
    replica_group: object = None   # dp x cp: the ranks holding the same parameter shards


def coordinates(rank: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
    """(dp rank, tp rank, cp rank) of a global rank: dp-major, then cp, tp ranks consecutive."""
    return rank // (tp * cp), rank % tp, (rank // tp) % cp


def offline_spec(options, rank: int) -> MeshSpec:
    """The mesh spec of ``rank`` when lowering without process groups (group names are labels)."""
    dp_rank, tp_rank, cp_rank = coordinates(rank, options.tp, options.cp)
    return MeshSpec(dp=options.dp, tp=options.tp, dp_rank=dp_rank, tp_rank=tp_rank, cp=options.cp,
                    cp_rank=cp_rank, sequence_parallel=options.sequence_parallel, output=options.output)


def make_mesh(options, device_type: str | None = None) -> RankMesh | None:
    """The mesh for this process, or None when no process group exists and none can be set up.
    A group started here uses the backend for ``device_type`` (the model's: gloo for a CPU model
    even on a machine with GPUs)."""
    if not dist.is_initialized():
        if not launched():
            return None
        init_distributed(options.comm_timeout, backend_for_device(device_type))
    world = dist.get_world_size()
    if world != options.world_size:
        raise MambacRuntimeError(f"mambac.compile(world_size={options.world_size}) but the process group has {world} "
                                 f"ranks; pass world_size={world} (or launch {options.world_size} processes).")
    from torch.distributed.device_mesh import init_device_mesh
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (options.dp, options.cp, options.tp), mesh_dim_names=("dp", "cp", "tp"))
    rank = dist.get_rank()
    tp_group, dp_group, cp_group = mesh.get_group("tp"), mesh.get_group("dp"), mesh.get_group("cp")
    dp_rank, tp_rank, cp_rank = coordinates(rank, options.tp, options.cp)
    spec = MeshSpec(dp=options.dp, tp=options.tp, dp_rank=dp_rank, tp_rank=tp_rank,
                    dp_group=dp_group.group_name, tp_group=tp_group.group_name,
                    sequence_parallel=options.sequence_parallel, output=options.output,
                    cp=options.cp, cp_rank=cp_rank, cp_group=cp_group.group_name)
    replica = dp_group if options.cp == 1 else cp_group if options.dp == 1 else _replica_group(options, rank)
    return RankMesh(spec=spec, rank=rank, tp_group=tp_group, dp_group=dp_group, device_mesh=mesh,
                    cp_group=cp_group, replica_group=replica)


def _replica_group(options, rank: int):
    """The group of ranks with this rank's tp coordinate (dp x cp of them).  Every rank creates
    every such group, in the same order, as ``new_group`` requires."""
    mine = None
    for t in range(options.tp):
        ranks = [(d * options.cp + c) * options.tp + t for d in range(options.dp) for c in range(options.cp)]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine
