"""Start a ``tests/training/worker.py`` scenario on W gloo processes (the environment and the hard
deadline of ``tests/distributed/harness.py``) and return each rank's ``RESULT`` object."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from tests.distributed.harness import ROOT, _env, free_port


def run_ranks(world: int, scenario: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> list[dict]:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.training.worker", scenario, *args], cwd=ROOT,
                              env=_env(r, world, port, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in range(world)]
    deadline, outputs = time.monotonic() + timeout, []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(0.1, deadline - time.monotonic()))[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [(p.communicate()[0] or "")[-1500:] for p in procs]
        raise AssertionError(f"scenario {scenario!r} passed its {timeout:.0f}s deadline; "
                             + "\n".join(f"--- rank {r}:\n{t}" for r, t in enumerate(tails)))
    results = []
    for r, (p, out) in enumerate(zip(procs, outputs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            raise AssertionError(f"rank {r} of scenario {scenario!r} exited {p.returncode}:\n{out[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results
