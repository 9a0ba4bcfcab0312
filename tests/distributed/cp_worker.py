"""Context-parallel scenario (run by ``worker.py cp`` on 2 or 4 gloo ranks).

For every sequence op and several lengths (multiples of ranks x chunk and not, including pieces
shorter than the conv halo), each rank builds the same full inputs from one seed, runs the op's
context-parallel form on its piece, and compares with the single-process op on the full
sequence: its output piece, and the input gradients of a fixed random linear loss (each rank's
gradients are summed over the ranks, as each holds the part its own loss put there).

With ``MAMBAC_TEST_CP_KERNELS=triton`` (and ``TRITON_INTERPRET=1``) only SSD runs, its context-parallel
form on the generated kernels under the interpreter (``cp_ssd_fused``, the exchange inside the
autograd Function), the single-process reference in PyTorch; each result records the autograd node
that produced the output, so the test can tell which form ran.
"""
from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist

from mambac.ops import use_kernels
from mambac.runtime import context_parallel as cp
from tests.helpers import rel_err

SEQ_DIM = {"conv": 2, "selective_scan": 2}  # ops whose sequence axis is not dim 1


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(op: str, L: int, seed: int) -> dict[str, torch.Tensor]:
    g = _g(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).requires_grad_()

    def neg(*s):
        return (-torch.rand(*s, generator=g) - 0.2).requires_grad_()

    b, h, p, n = 2, 4, 4, 8
    if op == "conv":
        return dict(x=r(b, 6, L), weight=r(6, 4), bias=r(6))
    if op == "selective_scan":
        return dict(u=r(b, 6, L), delta=r(b, 6, L), A=neg(6, n), B=r(b, n, L), C=r(b, n, L), D=r(6), z=r(b, 6, L),
                    delta_bias=r(6))
    if op == "ssd":
        return dict(x=r(b, L, h, p), dt=r(b, L, h), A=neg(h), B=r(b, L, 2, n), C=r(b, L, 2, n), D=r(h),
                    z=r(b, L, h, p), dt_bias=r(h))
    common = dict(x=r(b, L, h, p), dt=(torch.rand(b, L, h, generator=g) + 0.1).requires_grad_(),
                  adt=neg(b, L, h), trap=r(b, L, h), angles=r(b, L, h, 2), D=r(h), z=r(b, L, h, p))
    if op == "mamba3_siso":
        return dict(common, B=r(b, L, 2, n), C=r(b, L, 2, n), B_bias=r(h, n), C_bias=r(h, n))
    return dict(common, B=r(b, L, 2, 2, n), C=r(b, L, 2, 2, n), B_bias=r(h, 2, n), C_bias=r(h, 2, n),
                mimo_x=r(h, 2, p), mimo_z=r(h, 2, p), mimo_o=r(h, 2, p))


def full_op(op: str, t: dict, all_outputs: bool = False):
    """The single-process op on the full sequence: its output (every output with ``all_outputs``)."""
    out = _full_outputs(op, t)
    return out if all_outputs else out[0]


def _full_outputs(op: str, t: dict) -> tuple:
    m = torch.ops.mambac
    if op == "conv":
        return m.causal_conv1d(t["x"], t["weight"], t["bias"], None, "silu")
    if op == "selective_scan":
        return m.selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"], None,
                                True)
    if op == "ssd":
        return m.ssd(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["z"], t["dt_bias"], None, 4, True, 0.0,
                     math.inf)
    if op == "mamba3_siso":
        return m.mamba3_siso(t["x"], t["B"], t["C"], t["dt"], t["adt"], t["trap"], t["angles"], t["B_bias"],
                             t["C_bias"], t["D"], t["z"], None, None, None, None, 4)
    return m.mamba3_mimo(t["x"], t["B"], t["C"], t["dt"], t["adt"], t["trap"], t["angles"], t["B_bias"],
                         t["C_bias"], t["mimo_x"], t["mimo_z"], t["mimo_o"], t["D"], t["z"], None, None, None,
                         None, 4)


def cp_op(op: str, t: dict, L: int, rank: int, world: int, group: str) -> torch.Tensor:
    d = SEQ_DIM.get(op, 1)
    loc = {k: cp.local_piece(v, d, rank, world) if v.dim() >= 3 and v.shape[d] == L else v for k, v in t.items()}
    if op == "conv":
        return cp.cp_causal_conv1d(loc["x"], loc["weight"], loc["bias"], "silu", L, rank, world, group)
    if op == "selective_scan":
        return cp.cp_selective_scan(loc["u"], loc["delta"], loc["A"], loc["B"], loc["C"], loc["D"], loc["z"],
                                    loc["delta_bias"], True, rank, world, group)
    if op == "ssd":
        return cp.cp_ssd(loc["x"], loc["dt"], loc["A"], loc["B"], loc["C"], loc["D"], loc["z"], loc["dt_bias"], 4,
                         True, 0.0, math.inf, rank, world, group)
    args = [loc[k] for k in ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias")]
    if op == "mamba3_siso":
        return cp.cp_mamba3_siso(*args, loc["D"], loc["z"], 4, rank, world, group)
    return cp.cp_mamba3_mimo(*args, loc["mimo_x"], loc["mimo_z"], loc["mimo_o"], loc["D"], loc["z"], 4, rank,
                             world, group)


def check(op: str, L: int, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD.group_name
    d = SEQ_DIM.get(op, 1)
    ref_in, cp_in = inputs(op, L, seed), inputs(op, L, seed)
    ref = full_op(op, ref_in)
    w = torch.randn(ref.shape, generator=_g(seed + 1))
    (ref * w).sum().backward()
    with use_kernels(KERNELS) if KERNELS else contextlib.nullcontext():
        out, *finals = cp_op(op, cp_in, L, rank, world, group)
    full_finals = full_op(op, inputs(op, L, seed), all_outputs=True)[1:]
    final_err = max(rel_err(a, b) for a, b in zip(finals, full_finals)) if rank == world - 1 else 0.0
    (out * cp.local_piece(w, d, rank, world)).sum().backward()
    grads = {}
    for k, v in cp_in.items():
        gsum = v.grad.clone()
        dist.all_reduce(gsum)
        grads[k] = rel_err(gsum, ref_in[k].grad)
    return {"out": rel_err(out, cp.local_piece(ref, d, rank, world)), "grad": max(grads.values()), "final": final_err,
            "worst": max(grads, key=grads.get), "node": out.grad_fn.name()}


def check_bf16(op: str, L: int, seed: int) -> dict:
    """bf16 inputs at a longer length whose per-step decays are small (the pieces' total log-decays
    are sums of many small terms, which bf16 could not carry): each rank's output piece against the
    float64 op on the whole sequence, and the dtype of the summaries the exchange carries."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = SEQ_DIM.get(op, 1)
    t = inputs(op, L, seed)
    with torch.no_grad():   # steps of log-decay about -0.005: a piece's total is a sum of hundreds
        for k in ("delta", "dt"):
            if k in t and not op.startswith("mamba3"):   # Mamba-3 takes its log-decay as adt
                t[k].copy_(torch.full_like(t[k], -5.3))  # softplus(-5.3 + bias) is about 0.005
        if "delta_bias" in t:
            t["delta_bias"].zero_()
        if "dt_bias" in t:
            t["dt_bias"].zero_()
        for k in ("A", "adt"):
            if k in t:
                t[k].copy_(-torch.rand(t[k].shape, generator=_g(seed)) * 0.5 - 0.5 if k == "A" else
                           -0.005 * (torch.rand(t[k].shape, generator=_g(seed)) + 0.5))
    ref = full_op(op, {k: v.detach().double() for k, v in t.items()})
    half = {k: v.detach().to(torch.bfloat16) if v.dim() >= 3 else v.detach() for k, v in t.items()}
    seen: list[torch.Tensor] = []
    plain = cp.exchange

    def recording(summary, *args):
        seen.append(summary.detach().clone())
        return plain(summary, *args)

    group = dist.group.WORLD.group_name
    cp.exchange = recording
    try:
        out = cp_op(op, half, L, rank, world, group)[0]
        # the same values in float64: the summaries this rank sent must agree to fp32 precision
        cp_op(op, {k: v.double() for k, v in half.items()}, L, rank, world, group)
    finally:
        cp.exchange = plain
    return {"out": rel_err(out.double(), cp.local_piece(ref, d, rank, world)), "dtype": str(out.dtype),
            "summaries": str(seen[0].dtype), "summary_err": rel_err(seen[0].double(), seen[1])}


KERNELS = os.environ.get("MAMBAC_TEST_CP_KERNELS", "")   # "" (the default mode) or "triton"


def scenario_cp(world: int) -> dict:
    torch.set_default_dtype(torch.float32)
    lengths = (8, 11) if world == 2 else (16, 9)   # multiple of world x chunk (4), and not
    res = {}
    ops = ("ssd",) if KERNELS else ("conv", "selective_scan", "ssd", "mamba3_siso", "mamba3_mimo")
    for op in ops:
        for i, L in enumerate(lengths):
            res[f"{op}/{L}"] = check(op, L, seed=10 * i + len(op))
    if not KERNELS:
        for op in ("selective_scan", "ssd", "mamba3_siso", "mamba3_mimo"):
            res[f"{op}/bf16"] = check_bf16(op, 128 * world, seed=len(op))
    return res
