"""Test-wide settings: the verifier runs after every pass; small thread count (CI has 2 cores)."""
from __future__ import annotations

import os

os.environ.setdefault("MAMBAC_VERIFY", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import mambac.knobs  # noqa: E402

mambac.knobs.reload()
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(1234)
    yield
