"""Tests under tests/convert: ``@pytest.mark.gpu`` tests run only where CUDA is available."""
from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    # a setup hook (not a fixture) so it runs before module-scoped fixtures that import GPU-only code
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (GPU tier)")
