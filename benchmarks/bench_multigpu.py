"""Several GPUs (NCCL): correctness of every layout, tensor-parallel scaling, long-context weak
scaling and the time spent waiting on collectives.  One rank per GPU, launched with
``mambac run -n W benchmarks/bench_multigpu.py MODE [MODE ...] [options]`` (or torchrun); rank 0 prints a
markdown table per mode.  ``--tiny`` runs small models on the CPU with gloo (how CI checks this script).

Modes:
  correctness  logits, loss and every parameter gradient of the compiled Mamba-2 and Mamba-3 LMs
               under tp, tp + sequence parallel, cp, tp x cp and dp x tp, against the same model
               on one device (each rank computes that reference itself; bf16 autocast on GPUs,
               fp32 on the CPU); relative errors in norm and the tolerance applied
  scaling      a 1.3B Mamba-2 LM (d_model 2048, 48 layers) at tp = W, global batch W x
               --batch (the same per-GPU batch): tokens/s and peak memory per GPU.  Run it at
               W = 1, 2, 4, 8; the efficiency is tokens/s(W) / (W x tokens/s(1))
  longctx      the 130M Mamba-2 LM at --seqlen (e.g. 131072 on 4 GPUs, 524288 on 8) with cp = W:
               tokens/s per GPU and peak memory per GPU (compare with W = 1 at 32768)
  overlap      the share of a training step spent in communication kernels (torch.profiler: NCCL
               kernel time over the step's GPU time) for --layout (tp, cp, tpxcp, dpxtp)
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import mambac
from mambac.models import MambaConfig, MambaLMHeadModel

M2_130M = dict(d_model=768, n_layer=24, vocab_size=50288, ssm_cfg=dict(layer="Mamba2", d_state=128, headdim=64,
                                                                       chunk_size=256))
M2_1B3 = dict(d_model=2048, n_layer=48, vocab_size=50288, ssm_cfg=dict(layer="Mamba2", d_state=128, headdim=64,
                                                                       chunk_size=256))
TINY = {"mamba2": dict(d_model=32, n_layer=1, vocab_size=64, ssm_cfg=dict(layer="Mamba2", d_state=8, headdim=8,
                                                                          ngroups=2, chunk_size=8)),
        "mamba3": dict(d_model=32, n_layer=1, vocab_size=64, ssm_cfg=dict(layer="Mamba3", d_state=8, headdim=8,
                                                                          ngroups=2, chunk_size=8))}
GPU_CORRECT = {"mamba2": dict(M2_130M, n_layer=2),
               "mamba3": dict(d_model=768, n_layer=2, vocab_size=50288,
                              ssm_cfg=dict(layer="Mamba3", d_state=128, headdim=64, ngroups=2, chunk_size=64))}


def layouts(world: int) -> dict[str, dict]:
    out = {"tp": dict(tp=world), "tp+sp": dict(tp=world, sequence_parallel=True), "cp": dict(cp=world)}
    if world >= 4 and world % 2 == 0:
        out["tp x cp"] = dict(tp=2, cp=world // 2)
        out["dp x tp"] = dict(dp=2, tp=world // 2)
    elif world == 2:
        out["dp x tp"] = dict(dp=2, tp=1)
    return out


def setup(tiny: bool) -> tuple[str, int, int]:
    """The process group through mambac's own start-up (it picks this rank's GPU first, and at exit
    the ranks meet before closing the group, so no rank closes connections another still uses)."""
    from mambac.runtime.mesh import init_distributed
    backend = "gloo" if tiny or not torch.cuda.is_available() else "nccl"
    init_distributed(backend=backend)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if backend == "nccl" else "cpu"
    return device, dist.get_rank(), dist.get_world_size()


def build(cfg: dict, device: str, seed: int = 0) -> MambaLMHeadModel:
    torch.manual_seed(seed)
    return MambaLMHeadModel(MambaConfig(**cfg), device=device)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def full_grads(compiled) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at the unsharded shape (collective over the tp ranks)."""
    from mambac.runtime.checkpoint import _gather_param, rank_plans
    setup_, plans = compiled.rank_setup, rank_plans(compiled)
    return {name: (_gather_param(name, p.grad, plans, compiled.mesh) if setup_.plan.layout_of(name) is not None
                   else p.grad) for name, p in setup_.model.named_parameters()}


def autocast(device: str):
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def correctness(args, device: str, rank: int, world: int) -> list[str]:
    tol = {"logits": 3e-2, "loss": 1e-2, "grad": 5e-2} if device != "cpu" else {"logits": 1e-5, "loss": 1e-5,
                                                                                 "grad": 1e-5}
    rows = ["| model | layout | logits | loss | worst grad | tolerance (logits/loss/grad) | ok |", "|" + "---|" * 7]
    models = TINY if args.tiny else GPU_CORRECT
    seqlen = 37 if args.tiny else 1000            # not a multiple of cp x chunk
    for family, cfg in models.items():
        for name, opts in layouts(world).items():
            model = build(cfg, device)
            compiled = mambac.compile(model, world_size=world, **opts)
            g = torch.Generator().manual_seed(5)
            ids = torch.randint(0, cfg["vocab_size"], (4, seqlen), generator=g).to(device)
            labels = torch.randint(0, cfg["vocab_size"], (4, seqlen), generator=g).to(device)
            with autocast(device):
                e = {"logits": rel(compiled(ids).float(), model(ids).float())}
                loss_c, loss_e = compiled(ids, labels), model(ids, labels)
            e["loss"] = rel(loss_c.detach(), loss_e.detach())
            loss_c.backward()
            loss_e.backward()
            ref = dict(model.named_parameters())
            e["grad"] = max(rel(v, ref[k].grad) for k, v in full_grads(compiled).items())
            ok = all(e[k] <= tol[k] for k in tol)
            rows.append(f"| {family} | {name} | {e['logits']:.1e} | {e['loss']:.1e} | {e['grad']:.1e} | "
                        f"{tol['logits']:.0e}/{tol['loss']:.0e}/{tol['grad']:.0e} | {'yes' if ok else 'NO'} |")
            del compiled, model
    return rows


def train_steps(compiled, ids, labels, steps: int, device: str) -> float:
    """Seconds per AdamW step (after two warm-up steps)."""
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4, fused=device.startswith("cuda"))

    def step():
        with autocast(device):
            loss = compiled(ids, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    dist.barrier()


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else float("nan")


def scaling(args, device: str, rank: int, world: int) -> list[str]:
    cfg = TINY["mamba2"] if args.tiny else M2_1B3
    seqlen = 64 if args.tiny else 2048
    batch = args.batch * world
    compiled = mambac.compile(build(cfg, device), world_size=world, tp=world)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (batch, seqlen), generator=g).to(device)
    labels = torch.randint(0, cfg["vocab_size"], (batch, seqlen), generator=g).to(device)
    dt = train_steps(compiled, ids, labels, args.steps, device)
    return ["| model | tp | global batch x seqlen | tokens/s | tokens/s per GPU | peak GiB per GPU |", "|" + "---|" * 6,
            f"| {'tiny' if args.tiny else '1.3B'} Mamba-2 | {world} | {batch} x {seqlen} | {batch * seqlen / dt:,.0f} | "
            f"{batch * seqlen / dt / world:,.0f} | {peak_gib(device):.1f} |"]


def longctx(args, device: str, rank: int, world: int) -> list[str]:
    cfg = TINY["mamba2"] if args.tiny else M2_130M
    seqlen = args.seqlen or (256 if args.tiny else 131072)
    opts = dict(cp=world, cp_inputs="local") if world > 1 else {}
    compiled = mambac.compile(build(cfg, device), world_size=world, **opts)
    from mambac.runtime.collectives import split_sizes, split_start
    start, size = split_start(seqlen, world, rank), split_sizes(seqlen, world)[rank]
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg["vocab_size"], (1, seqlen + 1), generator=g)
    ids = tokens[:, start:start + size].to(device)
    labels = tokens[:, start + 1:start + size + 1].to(device)
    dt = train_steps(compiled, ids, labels, args.steps, device)
    return ["| model | cp | seqlen | tokens/s | tokens/s per GPU | peak GiB per GPU |", "|" + "---|" * 6,
            f"| {'tiny' if args.tiny else '130M'} Mamba-2 | {world} | {seqlen} | {seqlen / dt:,.0f} | {seqlen / dt / world:,.0f} | "
            f"{peak_gib(device):.1f} |"]


def overlap(args, device: str, rank: int, world: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    cfg = TINY["mamba2"] if args.tiny else M2_130M
    seqlen = 64 if args.tiny else 8192
    opts = {"tp": dict(tp=world), "cp": dict(cp=world), "tpxcp": dict(tp=2, cp=world // 2),
            "dpxtp": dict(dp=2, tp=world // 2)}[args.layout]
    compiled = mambac.compile(build(cfg, device), world_size=world, **opts)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab_size"], (4, seqlen), generator=g).to(device)
    train_steps(compiled, ids, ids, 1, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        train_steps(compiled, ids, ids, args.steps, device)
    on_device = device.startswith("cuda")
    total = comm = 0.0
    for ev in prof.key_averages():
        t = ev.device_time_total if on_device else ev.self_cpu_time_total
        if on_device and ev.device_type.name != "CUDA":
            continue
        total += t
        if "nccl" in ev.key.lower() or "gloo" in ev.key.lower() or "c10d" in ev.key.lower():
            comm += t
    return ["| layout | world | communication share of step time |", "|" + "---|" * 3,
            f"| {args.layout} | {world} | {100 * comm / max(total, 1e-9):.1f}% |"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="+", choices=("correctness", "scaling", "longctx", "overlap"),
                    help="one or more modes, run in this order in the same launch")
    ap.add_argument("--tiny", action="store_true", help="small models on the CPU with gloo")
    ap.add_argument("--batch", type=int, default=8, help="per-GPU batch (scaling)")
    ap.add_argument("--seqlen", type=int, default=0, help="sequence length (longctx)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layout", default="tp", choices=("tp", "cp", "tpxcp", "dpxtp"), help="overlap mode")
    args = ap.parse_args(argv)
    device, rank, world = setup(args.tiny)
    ok = True
    for mode in args.mode:
        rows = {"correctness": correctness, "scaling": scaling, "longctx": longctx, "overlap": overlap}[mode](
            args, device, rank, world)
        if rank == 0:
            name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu (gloo)"
            print(f"{mode} on {world} x {name}, torch {torch.__version__}")
            print("\n".join(rows), flush=True)
        ok = ok and all("| NO |" not in r for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
