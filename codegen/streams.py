"""A second CUDA stream for the independent branch of an op's launches.

The SSD backward has two chains that meet only at its end: the state chain (dstate, the reverse
state passing, dx) and the pair chain (the pair weights dcb, then dC).  Its kernels are
latency-bound at a few programs per SM, so running the two chains side by side fills the SMs with
programs of both.  The forward likewise forms C B^T beside the chunk states and their passing
(the sequential passing leaves most SMs idle).  ``Branch`` runs work on a per-device side stream
after everything the current stream has queued, and ``join`` makes the current stream wait for
it.  Tensors the branch allocates come from the side stream's pool; since every later branch
starts after the current stream's queued work, a block freed after the join is not reused while a
kernel still reads it.  Under CUDA graph capture the fork and join become edges of the graph.  On
the CPU (and with the knob off) the branch runs in place, in order.

The two-stream form is on by default: on an H200 it took the S1 fwd+bwd replayed from a CUDA graph
from 1450 to 1408 us and S2's from 2209 to 2142, with the same errors (benchmarks/NOTES_ssd.md,
v9).  ``MAMBAC_SSD_STREAMS=0`` (or ``knobs.override(ssd_streams=False)``) keeps every launch on
the current stream; ``benchmarks/bench_ssd.py check streams`` checks and times the two forms.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from mambac.knobs import knobs

_SIDE: dict[int, "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """The side stream of a CUDA device (made once), or None when branches run in place."""
    if device.type != "cuda" or not knobs().ssd_streams:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE.get(index)
    if stream is None:
        stream = _SIDE[index] = torch.cuda.Stream(device=index)
    return stream


class Branch:
    """``with branch.run(): ...`` queues work after the current stream's; ``branch.join()`` makes the
    current stream wait for that work (a no-op when the branch ran in place)."""

    def __init__(self, device: torch.device):
        self.side = side_stream(device)
        self.main = torch.cuda.current_stream(device) if self.side is not None else None

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        if self.side is None:
            yield
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            yield

    def join(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)

