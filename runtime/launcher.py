"""``mambac run -n W script.py args...``: start W ranks of a script with ``torch.distributed.run``.

The ranks get torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK);
``mambac.compile(model, world_size=W, ...)`` in the script then initialises the process group from
it (gloo on CPU, NCCL on GPU) with ``comm_timeout`` seconds, or uses the one the script set up.
One node by default (a free local port); ``extra`` passes further torchrun options (e.g.
``["--nnodes", "2", "--rdzv-endpoint", "host:29400"]``).  If a rank fails, torchrun stops the
others and reports which rank exited with what; ``launch`` returns the exit status.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Sequence

from mambac.errors import MambacInputError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nprocs: int, script: str, args: Sequence[str] = (), extra: Sequence[str] = ()) -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line ``launch`` runs."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise MambacInputError(f"mambac run: -n must be a positive number of processes, got {nprocs!r}.")
    if not os.path.exists(script):
        raise MambacInputError(f"mambac run: script {script!r} does not exist.")
    rdzv = [] if any(a.startswith("--rdzv") or a.startswith("--master") for a in extra) else \
        ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nprocs), *rdzv, *extra,
            script, *args]


def launch(nprocs: int, script: str, args: Sequence[str] = (), extra: Sequence[str] = (),
           timeout: float | None = None, max_restarts: int = 0) -> int:
    """Run ``script`` on ``nprocs`` ranks; returns the exit status (non-zero when any rank failed).

    ``timeout`` (seconds) bounds the whole run: when it passes every rank is stopped and 124 is
    returned, so a launch never hangs.  ``max_restarts``: when a rank fails, torchrun stops the
    others and starts every rank again, up to this many times (the script resumes from its last
    checkpoint, e.g. with ``mambac.trainer.Trainer.load``)."""
    if max_restarts:
        extra = [*extra, "--max-restarts", str(int(max_restarts))]
    cmd = torchrun_command(nprocs, script, args, extra)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"mambac run: stopped after {timeout:.0f}s (timeout)", file=sys.stderr)
        return 124
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()
