"""Start a ``tests/training/worker.py`` scenario on W gloo processes (the environment and the hard
deadline of ``tests/distributed/harness.py``) and return each rank's ``RESULT`` object."""
from __future__ import annotations

from tests.distributed import harness


def run_ranks(world: int, scenario: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> list[dict]:
    return harness.run_ranks(world, scenario, *args, timeout=timeout, env=env, module="tests.training.worker")
