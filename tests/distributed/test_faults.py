"""Failures end with clear errors, never hangs: differing inputs under MAMBAC_DEBUG, a rank that
stops calling (process-group timeout), a rank that died; and the ``mambac run`` launcher."""
import sys
from pathlib import Path

import pytest

from mambac.runtime.launcher import launch, torchrun_command
from mambac.errors import MambacInputError
from tests.distributed.harness import run_ranks

SCRIPT = Path(__file__).parent / "scripts" / "tp_forward.py"


@pytest.fixture(scope="module")
def faults():
    return run_ranks(2, "faults", timeout=120, env={"MAMBAC_DEBUG": "1", "MAMBAC_TEST_PG_TIMEOUT": "3"})


def test_debug_mode_detects_inputs_that_differ(faults):
    for rank, r in enumerate(faults):
        assert "ranks [1] were given inputs that differ" in r["debug"]
        assert f"seen on rank {rank}" in r["debug"]


def test_a_silent_rank_times_out_with_a_clear_error(faults):
    msg = faults[0]["hung_peer"]
    assert "on rank 0" in msg and "Timed out" in msg and "check the other ranks' logs" in msg
    assert "did not reach this point within 2s: [1]" in msg  # names the silent rank
    assert faults[0]["hung_peer_s"] < 30


def test_a_dead_rank_gives_a_clear_error(faults):
    msg = faults[0]["dead_peer"]
    assert "on rank 0" in msg and "did not reach this point within 2s: [1]" in msg
    assert faults[0]["dead_peer_s"] < 30


def test_launch_runs_a_script_on_w_ranks(tmp_path):
    out = tmp_path / "out"
    code = launch(2, str(SCRIPT), [str(out)], timeout=120)
    assert code == 0
    assert sorted(p.name for p in tmp_path.glob("out.rank*")) == ["out.rank0", "out.rank1"]
    assert all(p.read_text().startswith("ok") for p in tmp_path.glob("out.rank*"))


def test_launch_command_and_errors(tmp_path):
    cmd = torchrun_command(3, str(SCRIPT), ["a"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and cmd[-2:] == [str(SCRIPT), "a"]
    assert cmd[cmd.index("--nproc-per-node") + 1] == "3"
    with pytest.raises(MambacInputError, match="does not exist"):
        torchrun_command(2, str(tmp_path / "missing.py"))
    with pytest.raises(MambacInputError, match="positive"):
        torchrun_command(0, str(SCRIPT))


def test_mismatched_configurations_fail_at_compile_on_every_rank():
    results = run_ranks(2, "mismatch", timeout=90)
    errors = [r["error"] for r in results]
    assert errors[0] == errors[1] != ""
    assert "cp, tp differ" in errors[0] and "rank 0: cp=1, tp=2; rank 1: cp=2, tp=1" in errors[0]
