"""Compile options: one dataclass, validated before anything is captured or changed.

``CompileOptions.create(**kwargs)`` rejects unknown names (suggesting the closest known one),
values of the wrong kind, and contradictory combinations, each with a ``MambacOptionsError`` that
says what to do.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

from mambac.errors import MambacOptionsError

REMAT_MODES = ("none", "full", "auto")
KERNEL_MODES = ("auto", "triton", "reference")
OUTPUT_MODES = ("full", "sharded")
CP_INPUT_MODES = ("full", "local")
BUDGET_SCOPES = ("activations", "step")


@dataclass(frozen=True)
class CompileOptions:
    """Options of ``mambac.compile`` (and the torch.compile backend, and the CLI).

    world_size: ranks the program is lowered for; tp/dp/cp: the mesh (tp defaults to
    world_size // (dp*cp)); sequence_parallel: Megatron sequence parallelism over tp; remat and
    memory_budget (bytes, or a size such as '8GiB': ``mambac.sizes``): rematerialisation
    (memory_budget_scope: what the budget covers, 'activations' -- the bytes autograd saves for
    backward -- or 'step': those plus the rank's parameters, their gradients and AdamW's two fp32
    moments); kernels: 'auto' (Triton on CUDA, reference ops on CPU),
    'triton' or 'reference'; output: 'full' (gathered on every rank) or 'sharded'; verify/dump_dir/
    disable_passes override the MAMBAC_VERIFY/MAMBAC_DUMP_DIR/MAMBAC_DISABLE_PASSES knobs;
    plan: per-module overrides of the default Megatron layout, ``{module path: kind}`` (kinds in
    ``mambac.sharding_plan.KINDS``); comm_timeout: seconds a collective may wait before the process group
    gives up (used when mambac initialises the process group itself); cp_inputs: under context
    parallelism, 'full' (every rank passes the whole sequence, each keeps its piece) or 'local'
    (each rank passes only its own piece of the sequence, in rank order, the first ranks one token
    longer when cp does not divide the length).  ``plan="auto"`` (``mambac.compile`` only) lets
    the layout planner choose tp, dp, cp, sequence_parallel, remat and memory_budget for
    device_memory (bytes per device), batch and seqlen, which stay recorded here.  cuda_graphs: on
    CUDA, capture this rank's program as CUDA graphs (forward and backward) once per static input
    signature and replay them on later calls with that signature (``mambac.runtime.cuda_graphs``;
    parameters are read in place, so optimizer steps between calls are seen); needs CUDA parameters
    and, on several ranks, NCCL.
    """

    world_size: int = 1
    tp: int | None = None
    dp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    remat: str = "none"
    memory_budget: int | None = None
    memory_budget_scope: str = "activations"
    kernels: str = "auto"
    output: str = "full"
    verify: bool | None = None
    dump_dir: str | None = None
    disable_passes: tuple[str, ...] = ()
    plan: tuple[tuple[str, str], ...] = ()
    comm_timeout: float | None = None
    cp_inputs: str = "full"
    device_memory: int | None = None
    batch: int | None = None
    seqlen: int | None = None
    cuda_graphs: bool = False

    @classmethod
    def create(cls, **kwargs) -> "CompileOptions":
        names = [f.name for f in dataclasses.fields(cls)]
        for key in kwargs:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise MambacOptionsError(f"unknown compile option '{key}'.{hint} Known options: {', '.join(names)}.")
        if "disable_passes" in kwargs and isinstance(kwargs["disable_passes"], str):
            kwargs["disable_passes"] = tuple(p for p in kwargs["disable_passes"].split(",") if p)
        if isinstance(kwargs.get("plan"), dict):
            kwargs["plan"] = tuple(sorted(kwargs["plan"].items()))
        for name in ("memory_budget", "device_memory"):   # 8e9, "8GiB": whole bytes, as the CLI reads them
            kwargs[name] = _bytes_option(name, kwargs.get(name))
        opts = cls(**kwargs)
        opts._validate()
        if opts.tp is None:
            opts = dataclasses.replace(opts, tp=opts.world_size // (opts.dp * opts.cp))
        return opts

    def _validate(self) -> None:
        for name in ("world_size", "dp", "cp") + (("tp",) if self.tp is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise MambacOptionsError(f"{name} must be a positive integer, got {v!r}.")
        tp = self.tp if self.tp is not None else self.world_size // (self.dp * self.cp)
        if tp * self.dp * self.cp != self.world_size or tp < 1:
            hint = ""
            if self.world_size == 1:
                ranks = (self.tp or 1) * self.dp * self.cp
                hint = f" world_size is 1 unless given: for {ranks} ranks pass world_size={ranks}."
            raise MambacOptionsError(
                f"the mesh tp={self.tp if self.tp is not None else '?'} × dp={self.dp} × cp={self.cp} does not "
                f"multiply to world_size={self.world_size}; choose factors whose product is the world size.{hint}")
        _choice("remat", self.remat, REMAT_MODES)
        _choice("kernels", self.kernels, KERNEL_MODES)
        _choice("output", self.output, OUTPUT_MODES)
        _choice("cp_inputs", self.cp_inputs, CP_INPUT_MODES)
        _choice("memory_budget_scope", self.memory_budget_scope, BUDGET_SCOPES)
        if self.sequence_parallel and tp == 1:
            raise MambacOptionsError("sequence_parallel=True needs tensor parallelism (tp > 1): it shards the "
                                     "residual stream over the tp ranks. Set tp or drop sequence_parallel.")
        if self.memory_budget is not None and self.remat != "auto":
            raise MambacOptionsError("memory_budget is only used with remat='auto'; set remat='auto' or drop it.")
        if self.memory_budget is not None and (not isinstance(self.memory_budget, int) or self.memory_budget <= 0):
            raise MambacOptionsError(f"memory_budget must be a positive number of bytes, got {self.memory_budget!r}.")
        for name in ("sequence_parallel", "cuda_graphs") + (("verify",) if self.verify is not None else ()):
            if not isinstance(getattr(self, name), bool):
                raise MambacOptionsError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        for name in ("device_memory", "batch", "seqlen"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise MambacOptionsError(f"{name} must be a positive integer, got {v!r}.")
        if self.comm_timeout is not None and (isinstance(self.comm_timeout, bool)
                                              or not isinstance(self.comm_timeout, (int, float))
                                              or self.comm_timeout <= 0):
            raise MambacOptionsError(f"comm_timeout must be a positive number of seconds, got {self.comm_timeout!r}.")
        if self.plan == "auto":
            raise MambacOptionsError("plan='auto' needs the model: pass it to mambac.compile(model, plan='auto', ...), "
                                     "which chooses tp, dp, cp, sequence_parallel, remat and memory_budget.")
        if not all(isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in self.plan):
            raise MambacOptionsError("plan must map module paths to kinds, e.g. plan={'lm_head': 'replicate'}.")


def _bytes_option(name: str, value):
    """A size option as whole bytes (``mambac.sizes.parse_bytes``); None stays None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    from mambac.errors import MambacInputError
    from mambac.sizes import parse_bytes
    try:
        return parse_bytes(value)
    except MambacInputError as exc:
        raise MambacOptionsError(f"{name}: {exc}") from None


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise MambacOptionsError(f"{name} must be one of {list(allowed)}, got {value!r}.")
