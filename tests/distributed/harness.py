"""Run a scenario of ``tests/distributed/worker.py`` on W gloo processes, never hanging.

Each rank is a fresh ``python -m tests.distributed.worker SCENARIO`` process with the launcher
environment (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT); the harness waits for
all of them under a hard deadline, kills every one that is still running when it passes, and
returns each rank's result (the JSON object the worker prints on its last ``RESULT`` line).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int, extra: dict | None) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", MAMBAC_VERIFY="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra or {})
    return env


def run_ranks(world: int, scenario: str, *args: str, timeout: float = 150.0, env: dict | None = None,
              module: str = "tests.distributed.worker") -> list[dict]:
    """Start ``world`` ranks of ``scenario`` (of the worker ``module``); return their results in rank order.

    Raises AssertionError with every rank's output tail when a rank fails, prints no result, or
    the deadline passes (all ranks are killed first)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", module, scenario, *args], cwd=ROOT,
                              env=_env(r, world, port, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            left = max(0.1, deadline - time.monotonic())
            out, _ = p.communicate(timeout=left)
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [(p.communicate()[0] or "")[-1500:] for p in procs]
        raise AssertionError(f"scenario {scenario!r} on {world} ranks passed its {timeout:.0f}s deadline; "
                             + "\n".join(f"--- rank {r}:\n{t}" for r, t in enumerate(tails)))
    results = []
    for r, (p, out) in enumerate(zip(procs, outputs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise AssertionError(f"rank {r} of scenario {scenario!r} exited {p.returncode}:\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results
