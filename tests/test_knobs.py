"""The environment knobs: every spelling a knob accepts, and a clear error for one it cannot mean."""
from __future__ import annotations

import pytest

from mambac import knobs
from mambac.cli import main
from mambac.errors import MambacOptionsError


@pytest.fixture
def env(monkeypatch):
    """Set variables, re-read the knobs; the knobs are read again from the real environment after."""
    def set_(**values):
        for k, v in values.items():
            monkeypatch.setenv(k, v)
        return knobs.reload()
    yield set_
    monkeypatch.undo()
    knobs.reload()


def test_flags_take_the_usual_spellings(env):
    got = env(MAMBAC_VERIFY="YES", MAMBAC_TMA="off", MAMBAC_SSD_STREAMS=" 0 ", MAMBAC_DEBUG="true",
              MAMBAC_PROGRESS="on", MAMBAC_SSD_WALK="Auto", MAMBAC_KERNELS="Triton")
    assert (got.verify, got.tma, got.ssd_streams, got.debug) == (True, False, False, True)
    assert (got.progress, got.ssd_walk, got.kernels) == ("1", "auto", "triton")


@pytest.mark.parametrize("name, value, expected", [
    ("MAMBAC_VERIFY", "maybe", "expected 1 or 0"), ("MAMBAC_TMA", "2", "expected 1 or 0"),
    ("MAMBAC_KERNELS", "gpu", "expected auto, triton or reference"),
    ("MAMBAC_PROGRESS", "xyz", "expected auto, 1 or 0"), ("MAMBAC_SSD_WALK", "x", "expected auto, 1 or 0"),
    ("MAMBAC_SSD_CHUNK", "abc", "expected auto, model or a chunk length"),
])
def test_a_value_a_knob_cannot_mean_is_an_error_naming_it(env, name, value, expected):
    with pytest.raises(MambacOptionsError, match=f"{name}='{value}': {expected}"):
        env(**{name: value})


def test_the_cli_says_it_in_one_line(env, monkeypatch, capsys):
    monkeypatch.setenv("MAMBAC_KERNELS", "gpu")
    monkeypatch.setattr(knobs, "_current", None)   # read on first use, as in a fresh process
    assert main(["dump", "mamba2-tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambac: error: MAMBAC_KERNELS='gpu'") and "Traceback" not in err
