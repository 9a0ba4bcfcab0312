"""Autotune stage: pick a ``TileConfig`` per (kernel family, shape bucket, device) and keep it.

A *family* is one kernel of one region together with its candidate configs; its key hashes the
generated sources of every candidate, so a changed renderer never reuses stale choices.  The
choice is persisted in the on-disk cache, so a second process (or run) pays nothing.  Under the
Triton interpreter, or without a GPU, nothing is timed: the first candidate is used.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

import torch

from mambac.codegen import cache
from mambac.codegen.kernel_ir import TileConfig, pow2
from mambac.progress import progress

log = logging.getLogger("mambac.codegen")

_CHOSEN: dict[tuple[str, str], TileConfig] = {}


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_name() -> str:
    if interpreting() or not torch.cuda.is_available():
        return "interpreter"
    return torch.cuda.get_device_name().replace("|", "_")


def family_key(name: str, sources: Sequence[str], candidates: Sequence[TileConfig]) -> str:
    """Key of one kernel family: its name plus a hash of every candidate's source and config."""
    text = "\n".join(sorted(set(sources))) + "\n".join(c.to_json() for c in candidates)
    return f"{name}-{cache.content_hash(text)}"


def bucket_key(*sizes: int) -> str:
    """Shape bucket: sizes rounded up to powers of two (tile choices change slowly with size)."""
    return "x".join(str(pow2(s)) for s in sizes)


def choose(family: str, bucket: str, candidates: Sequence[TileConfig],
           bench: Callable[[TileConfig], float]) -> TileConfig:
    """The config for this family and bucket: remembered, persisted, or measured now.

    ``bench(config)`` runs the kernel with ``config`` and returns its time; a candidate whose
    compile or launch fails is skipped with a log line (another may still fit the device).
    """
    key = (family, f"{bucket}|{device_name()}")
    if key in _CHOSEN:
        return _CHOSEN[key]
    stored = cache.load_choices(family).get(key[1])
    if stored is not None:
        _CHOSEN[key] = TileConfig.from_json(stored)
        return _CHOSEN[key]
    if interpreting() or len(candidates) == 1 or not torch.cuda.is_available():
        _CHOSEN[key] = candidates[0]
        return candidates[0]
    best, best_t, errors = None, float("inf"), []
    for cfg in progress(candidates, f"mambac: autotuning {family}"):
        try:
            t = bench(cfg)
        except Exception as exc:  # a config may not fit (shared memory, registers)
            errors.append(f"{cfg.to_json()}: {exc!r}")
            log.info("autotune %s: skipping %s (%r)", family, cfg.to_json(), exc)
            continue
        log.info("autotune %s %s: %s -> %.1f us", family, bucket, cfg.to_json(), t * 1e3)
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"autotune {family}: every candidate failed:\n  " + "\n  ".join(errors))
    cache.save_choice(family, key[1], best.to_json())
    _CHOSEN[key] = best
    return best


def time_ms(fn: Callable[[], None]) -> float:
    """Milliseconds of ``fn``'s GPU work: replayed from a CUDA graph (``graph_ms``), so that the
    host's launch cost, which varies from host to host and can exceed a short kernel's time, does
    not decide the choice; where ``fn`` cannot be captured, timed directly (Triton's event-based
    median)."""
    try:
        return graph_ms(fn)
    except Exception as exc:  # not capturable: time the launches as they are
        log.info("autotune: timing without a CUDA graph (%r)", exc)
        torch.cuda.synchronize()
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def graph_ms(fn: Callable[[], None], target_ms: float = 0.2, reps: int = 10) -> float:
    """Milliseconds per call of ``fn`` from a CUDA graph holding k back-to-back calls (k so that
    one replay takes about ``target_ms``, at most 16; one call run first, outside the graph,
    compiles and estimates), the median of three timed groups of ``reps`` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        fn()
        start.record()
        fn()
        end.record()
        end.synchronize()
        k = max(1, min(16, int(target_ms / max(start.elapsed_time(end), 1e-3)) + 1))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(k):
                fn()
        graph.replay()
        times = []
        for _ in range(3):
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / (reps * k))
    torch.cuda.current_stream().wait_stream(stream)
    del graph
    return sorted(times)[1]
