"""``mambac.compile(model, plan="auto", ...)``: compile with the layout the planner ranks best.

The planner (``mambac.autoplan``) ranks every (tp, cp, dp, sequence_parallel, remat) of
``world_size`` ranks by predicted step time under the memory of one device; this module turns the
best row that ``mambac.compile`` can run into compile options: tp, dp, cp, sequence_parallel,
remat and, for remat='auto', memory_budget (the saved-activation bytes per rank the device has
room for once weights, gradients and optimizer state are placed).  A row whose options this
version rejects (``CompileOptions`` validation: a layout it cannot run) is skipped,
not fatal.  What it is planned for:

- ``batch`` and ``seqlen``: the options of that name, else dims 0 and 1 of the first tensor of
  ``example_inputs`` (the training batch), else an error saying to pass them;
- ``device_memory``: the option (bytes, or a size such as ``"80GiB"``), else 90% of the current
  CUDA device's memory (the rest left for what the planner does not count), else an error.

The chosen options are ``compiled.options`` (``device_memory``, ``batch`` and ``seqlen`` recorded
there too) and one INFO line on the ``mambac.plan`` logger; ``plan_rows`` returns the whole table.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from mambac.errors import MambacOptionsError
from mambac.options import CompileOptions

log = logging.getLogger("mambac.plan")

CHOSEN = ("tp", "dp", "cp", "sequence_parallel", "remat", "memory_budget")
PLANNED_FOR = ("device_memory", "batch", "seqlen")
HEADROOM = 0.9   # share of a CUDA device's memory given to the planner by default


def wants_auto(options: dict[str, Any]) -> bool:
    return isinstance(options.get("plan"), str) and options["plan"] == "auto"


def check_request(world_size: int, options: dict[str, Any]) -> None:
    """Before the model is touched: what plan='auto' chooses may not be given too, and the rest of
    the options must be valid on their own."""
    given = [k for k in CHOSEN if k in options]
    if given:
        raise MambacOptionsError(f"plan='auto' chooses {', '.join(CHOSEN)}; drop {', '.join(given)} "
                                 "or drop plan='auto' and give the whole layout yourself.")
    rest = {k: v for k, v in options.items() if k != "plan" and k not in PLANNED_FOR}
    CompileOptions.create(world_size=world_size, **rest)


def _batch_and_seqlen(options: dict[str, Any], example_inputs: Sequence[Any] | None) -> tuple[int, int]:
    batch, seqlen = options.get("batch"), options.get("seqlen")
    first = next((t for t in example_inputs or () if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if first is not None:
        batch = int(first.shape[0]) if batch is None else batch
        seqlen = int(first.shape[1]) if seqlen is None else seqlen
    if batch is None or seqlen is None:
        raise MambacOptionsError("plan='auto' plans for one training batch: pass batch= and seqlen= (sequences per "
                                 "step and tokens per sequence), or example_inputs=(input_ids, ...) of that shape.")
    return batch, seqlen


def _device_memory(options: dict[str, Any]) -> int:
    from mambac.sizes import parse_bytes
    value = options.get("device_memory")
    if value is not None:
        return parse_bytes(value)
    if torch.cuda.is_available():
        return int(HEADROOM * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    raise MambacOptionsError("plan='auto' needs the memory of one device and there is no CUDA device to ask: "
                             "pass device_memory= (bytes, or a size such as '80GiB').")


def plan_rows(model: torch.nn.Module, world_size: int, device_memory: int, batch: int, seqlen: int):
    """The planner's table for this model (a CUDA machine is modelled as H200s, else as CPUs)."""
    from mambac.autoplan import plan
    device = "h200" if torch.cuda.is_available() else "cpu"
    return plan(model, world_size=world_size, device_memory=device_memory, batch=batch, seqlen=seqlen,
                device=device)


def resolve(model: torch.nn.Module, world_size: int, example_inputs: Sequence[Any] | None,
            options: dict[str, Any]) -> CompileOptions:
    """The compile options of the best layout compile can run (see the module docstring)."""
    batch, seqlen = _batch_and_seqlen(options, example_inputs)
    memory = _device_memory(options)
    rows = plan_rows(model, world_size, memory, batch, seqlen)
    rest = {k: v for k, v in options.items() if k != "plan" and k not in PLANNED_FOR}
    rest.update(device_memory=memory, batch=batch, seqlen=seqlen)
    skipped = []
    for row in (r for r in rows if r.feasible):
        lay = row.layout
        chosen = dict(tp=lay.tp, dp=lay.dp, cp=lay.cp, sequence_parallel=lay.sequence_parallel, remat=lay.remat)
        if lay.remat == "auto":
            chosen["memory_budget"] = int(row.memory_budget)
        try:
            opts = CompileOptions.create(world_size=world_size, **rest, **chosen)
        except MambacOptionsError as exc:
            skipped.append(f"{lay}: {exc}")
            continue
        log.info("plan='auto' for batch %d x seqlen %d on %d device(s) of %d bytes: %s%s (predicted step %.3f ms, "
                 "%d bytes per rank)%s", batch, seqlen, world_size, memory, lay,
                 f" memory_budget={chosen['memory_budget']}" if "memory_budget" in chosen else "",
                 row.step_s * 1e3, int(row.memory), f"; skipped {len(skipped)} better layouts compile cannot run"
                 if skipped else "")
        return opts
    raise MambacOptionsError("plan='auto': every layout that fits is one this version of mambac cannot compile: "
                             + "; ".join(skipped[:4]))
