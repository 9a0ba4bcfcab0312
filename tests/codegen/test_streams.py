"""codegen/streams.py off the GPU: a branch runs in place, in order, and joining it does nothing."""
from __future__ import annotations

import torch

from mambac.codegen import streams


def test_cpu_branch_runs_in_place():
    order = []
    branch = streams.Branch(torch.device("cpu"))
    assert branch.side is None
    with branch.run():
        order.append("branch")
    order.append("main")
    branch.join()
    assert order == ["branch", "main"]


def test_on_by_default_and_the_knob_turns_it_off(monkeypatch):
    from mambac import knobs
    with knobs.override(ssd_streams=False):
        assert streams.side_stream(torch.device("cuda", 0)) is None   # decided before touching CUDA
    monkeypatch.setattr(streams, "_SIDE", {0: "the side stream"})
    with knobs.override(ssd_streams=True):
        assert streams.side_stream(torch.device("cuda", 0)) == "the side stream"
        assert streams.side_stream(torch.device("cpu")) is None
    assert knobs.Knobs().ssd_streams   # on unless MAMBAC_SSD_STREAMS=0
