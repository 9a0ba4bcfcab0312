"""The compiled module: the user's model, with its forward replaced by lowered programs.

On one rank it shares the model's submodules, parameters and buffers (the same objects), so
``state_dict()`` keys, ``parameters()``, optimizers, ``.to()`` and ``load_state_dict`` behave exactly
as on the original model, and gradients land on the original parameters.  One program is lowered
per forward signature (which optional arguments are given) on first use and cached.

On several ranks (``world_size > 1``) it is *this rank's* module: its parameters are this rank's
shards (a local copy of the model, ``mambac.sharding_plan.local_model``), its programs this rank's lowered
programs, its inputs the same full batch on every rank and its outputs full on every rank (or this
rank's piece with ``output='sharded'``).  ``state_dict()``/``load_state_dict()`` speak unsharded
tensors (both are collective calls: every rank calls them).  With dp > 1 the gradients of the
parameters are summed over the data-parallel ranks by ``DistributedDataParallel``.  Without a
process group the programs can still be lowered and printed for every rank
(``program_for_rank``); running one raises an error saying how to launch.

With ``cuda_graphs=True`` every call runs through ``mambac.runtime.cuda_graphs``: this rank's
program is captured as CUDA graphs once per static input signature and replayed afterwards
(``cuda_graph_stats`` counts captures and replays).
"""
from __future__ import annotations

import logging
import operator
import warnings
from typing import Any, Callable

import torch

from mambac.errors import MambacInputError, MambacRuntimeError
from mambac.knobs import knobs
from mambac.lowering import Lowered, bind_inputs, lower, rank_setup, signature_of
from mambac.options import CompileOptions

log = logging.getLogger("mambac.runtime")
_TRAINING = operator.attrgetter("training")


class _Runner(torch.nn.Module):
    """The local model plus the call into its lowered program (what DDP wraps)."""

    def __init__(self, local: torch.nn.Module, run: Callable) -> None:
        super().__init__()
        self.model = local
        self.__dict__["_run"] = run

    def forward(self, *values: Any) -> Any:
        return self.__dict__["_run"](values)


def _sum_hook(group, bucket):
    """DDP comm hook: sum (not average) gradients; the lowered loss already averages the batch."""
    import torch.distributed as dist
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


# options that change what each rank computes or exchanges (the others may differ between ranks)
_LAYOUT_FIELDS = ("world_size", "tp", "dp", "cp", "sequence_parallel", "remat", "memory_budget", "output", "plan",
                  "cp_inputs")


def check_same_config(model: torch.nn.Module, options: CompileOptions) -> None:
    """Every rank must compile the same model with the same layout, or their collectives would not
    match (a hang, or silently wrong numbers).  One small all-gather at compile time compares them;
    on a mismatch every rank raises the same error naming the ranks and what differs."""
    import hashlib
    import torch.distributed as dist
    shapes = "".join(f"{n}:{tuple(p.shape)}:{p.dtype};" for n, p in model.named_parameters())
    mine = {"model": f"{type(model).__name__} {hashlib.sha256(shapes.encode()).hexdigest()[:12]}"}
    mine.update({f: getattr(options, f) for f in _LAYOUT_FIELDS})
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = sorted({k for cfg in every for k in cfg if cfg[k] != every[0][k]})
    if differ:
        table = "; ".join(f"rank {r}: " + ", ".join(f"{k}={cfg[k]}" for k in differ) for r, cfg in enumerate(every))
        raise MambacRuntimeError(f"the ranks compiled different configurations ({', '.join(differ)} differ): "
                                 f"{table}. Every rank must call mambac.compile with the same model and options.")


class CompiledModule(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, options: CompileOptions,
                 check_inputs: Callable[[list[Any]], None] | None = None,
                 source: torch.nn.Module | None = None) -> None:
        """``source``: the model the user passed when ``model`` is its conversion (a Hugging Face
        or mamba_ssm model; they share their parameters), whose attributes stay reachable."""
        super().__init__()
        from mambac.runtime.cuda_graphs import CudaGraphs, check_supported
        check_supported(model, options)  # before any process group or local copy is made
        d = self.__dict__
        d.update(_mambac_model=model, _mambac_source=source, _mambac_options=options, _mambac_programs_by_mode={},
                 _mambac_check_inputs=check_inputs, _mambac_mesh=None, _mambac_setup=None, _mambac_ddp=None,
                 _mambac_current=None, _mambac_graphs=CudaGraphs() if options.cuda_graphs else None)
        target = model
        if options.world_size > 1:
            from mambac.runtime.mesh import make_mesh, offline_spec
            first = next(iter(model.parameters()), None)
            mesh = make_mesh(options, None if first is None else first.device.type)
            d["_mambac_mesh"] = mesh
            d["_mambac_setup"] = rank_setup(model, options, mesh.spec if mesh else offline_spec(options, 0))
            target = d["_mambac_setup"].model
        # the modules whose training flags a captured graph may have read (``if self.training:``
        # is decided at capture): programs are kept per combination of those flags
        d["_mambac_mode_modules"] = tuple(target.modules())
        # Share the module tree instead of wrapping it: same keys, same Parameter objects.
        self._modules = target._modules
        self._parameters = target._parameters
        self._buffers = target._buffers
        if d["_mambac_mesh"] is not None:
            check_same_config(model, options)
        if d["_mambac_mesh"] is not None and options.dp * options.cp > 1:
            # gradients summed over the replicas of each shard: the dp ranks and the cp ranks
            from torch.nn.parallel import DistributedDataParallel
            group = d["_mambac_mesh"].replica_group
            runner = _Runner(target, self._run_values)
            with warnings.catch_warnings():  # newer torch renames broadcast_buffers; the meaning is ours
                warnings.simplefilter("ignore", FutureWarning)
                ddp = DistributedDataParallel(runner, process_group=group, broadcast_buffers=False)
            ddp.register_comm_hook(group, _sum_hook)
            d["_mambac_ddp"] = ddp

    def __reduce__(self):
        """Pickled (``torch.save``, ``copy.deepcopy``) as the model and the options: the copy shares
        the copied model's parameters and lowers its programs again on its first call.  A module
        of several ranks holds process groups and this rank's shards, so it is refused."""
        if self.options.world_size > 1:
            raise MambacRuntimeError(
                f"a module compiled for world_size={self.options.world_size} cannot be pickled or deep-copied: "
                "it holds this rank's shards and the process groups. Save compiled.state_dict() (unsharded; "
                "every rank calls it) or a sharded checkpoint (docs/parallel.md), and call mambac.compile "
                "on the loaded model.")
        d = self.__dict__
        return (_rebuild, (self.original_module, self.options, d["_mambac_check_inputs"], d["_mambac_source"]))

    def __getattr__(self, name: str) -> Any:
        """What the compiled module does not have itself (a user model's helper methods and
        fields; for a converted model, the Hugging Face or mamba_ssm model's it was converted
        from first, such as ``generate``, ``config`` or ``save_pretrained`` in that library's
        format, then the converted model's) is the model's own, as with ``torch.compile``: on
        one rank they all share their parameters, and such methods run the model's own code, not
        the lowered programs.  On several ranks the model holds unsharded parameters this rank does
        not train, so its methods and modules are refused with a message instead of reading stale
        weights (plain values such as a ``config`` are passed on)."""
        try:
            return super().__getattr__(name)   # parameters, buffers, child modules
        except AttributeError:
            pass
        d = self.__dict__
        if name.startswith("__") or "_mambac_model" not in d:   # copy / pickle probes, a half-built module
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        owners = [m for m in (d["_mambac_source"], d["_mambac_model"]) if m is not None]   # the model passed in first
        owner = next((m for m in owners if hasattr(m, name)), None)
        names = " nor ".join(type(m).__name__ for m in owners)
        if owner is None:
            raise AttributeError(f"neither the compiled module nor its model ({names}) has an attribute '{name}'")
        value = getattr(owner, name)
        if d["_mambac_options"].world_size > 1 and (callable(value) or isinstance(value, torch.nn.Module)):
            raise AttributeError(
                f"'{name}' is a method or module of the model ({type(owner).__name__}), which a module compiled "
                f"for world_size={d['_mambac_options'].world_size} does not pass on: this rank trains copies of "
                "its parameter shards, so the model's own code would read its untrained, unsharded weights. Call "
                "it on a model that loads compiled.state_dict() (unsharded; every rank calls it).")
        return value

    @property
    def original_module(self) -> torch.nn.Module:
        return self.__dict__["_mambac_model"]

    @property
    def options(self) -> CompileOptions:
        return self.__dict__["_mambac_options"]

    @property
    def programs(self) -> dict[tuple[bool, ...], Lowered]:
        """The lowered programs of the current training / eval flags, one per forward signature
        seen so far in that mode."""
        modes = tuple(map(_TRAINING, self.__dict__["_mambac_mode_modules"]))
        return self.__dict__["_mambac_programs_by_mode"].setdefault(modes, {})

    def train(self, mode: bool = True) -> "CompiledModule":
        """Set training (or eval) mode on the shared modules and on the model itself (its own flag
        is not one of the shared children); the next call runs the program of that mode."""
        super().train(mode)
        self.__dict__["_mambac_mode_modules"][0].training = mode
        return self

    @property
    def rank_setup(self):
        """This rank's local model, plan and mesh spec (None on one rank)."""
        return self.__dict__["_mambac_setup"]

    @property
    def mesh(self):
        """This process's ``RankMesh`` (process groups), or None without a process group."""
        return self.__dict__["_mambac_mesh"]

    @property
    def cuda_graph_stats(self):
        """``CudaGraphStats`` (signatures captured, calls replayed, calls run eagerly) with
        ``cuda_graphs=True``; None without."""
        graphs = self.__dict__["_mambac_graphs"]
        return graphs.stats if graphs is not None else None

    def program_for(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower (or fetch) the program for this call's signature without running it."""
        values = bind_inputs(self.original_module, args, kwargs)
        length = None
        if self.options.cp > 1:
            from mambac.lowering import cp_pieces
            values, length = cp_pieces(values, self.rank_setup.mesh.cp_rank, self.options.cp)
        return self._program(values, length)

    def _program(self, values: list[Any], length: int | None) -> Lowered:
        """The program for these bound inputs (this rank's pieces and the whole length under cp)."""
        key = signature_of(values) + ((length,) if length is not None else ())
        programs = self.programs
        if key not in programs:
            log.info("lowering %s for signature %s", type(self.original_module).__name__, key)
            rank = self.mesh.rank if self.mesh is not None else 0
            programs[key] = lower(self.original_module, values, self.options, rank, self.rank_setup, length)
        return programs[key]

    def program_for_rank(self, rank: int, *args: Any, **kwargs: Any) -> Lowered:
        """Rank ``rank``'s program for these example inputs, lowered without running anything (any
        rank's program can be produced on any process, with or without a process group)."""
        from mambac.runtime.mesh import offline_spec
        opts = self.options
        if not 0 <= rank < opts.world_size:
            raise MambacRuntimeError(f"rank {rank} is outside world_size={opts.world_size}.")
        if self.mesh is not None and rank == self.mesh.rank:
            return self.program_for(*args, **kwargs)
        values = bind_inputs(self.original_module, args, kwargs)
        setup = rank_setup(self.original_module, opts, offline_spec(opts, rank)) if opts.world_size > 1 else None
        length = None
        if opts.cp > 1:
            from mambac.lowering import cp_pieces
            values, length = cp_pieces(values, setup.mesh.cp_rank, opts.cp)
        return lower(self.original_module, values, opts, rank, setup, length)

    def _run_values(self, values) -> Any:
        program = self.__dict__["_mambac_current"] or self.program_for(*values)
        return self._execute(program, list(values))

    def _execute(self, program: Lowered, values: list[Any]) -> Any:
        """Run ``program`` on bound inputs: replayed CUDA graphs with ``cuda_graphs=True``, else eagerly."""
        def run(vals: list[Any]) -> Any:
            from mambac.ops import use_kernels
            with use_kernels(self.options.kernels):  # generated kernels or reference ops
                return program.gm(*vals)
        graphs = self.__dict__["_mambac_graphs"]
        return run(values) if graphs is None else graphs.run(program, values, run)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            values = bind_inputs(self.original_module, args, kwargs)
        except MambacInputError as exc:
            source = self.__dict__["_mambac_source"]
            if source is None:
                raise
            raise MambacInputError(
                f"{exc}. The compiled module runs mambac's {type(self.original_module).__name__}, converted from "
                f"{type(source).__name__}: arguments of {type(source).__name__}.forward that the converted model "
                "does not have (use_cache, attention_mask, return_dict, ...) are not taken, and its labels are "
                "already shifted (docs/models.md).") from None
        check = self.__dict__["_mambac_check_inputs"]
        if check is not None:
            check(values)
        if self.options.world_size > 1:
            return self._forward_distributed(values)
        program = self.program_for(*args, **kwargs)
        return self._execute(program, values)

    def _forward_distributed(self, values: list[Any]) -> Any:
        if self.mesh is None:
            from mambac.runtime.mesh import launch_hint
            raise MambacRuntimeError(f"this module was compiled for world_size={self.options.world_size} but no "
                                     "process group is initialised, so it can be lowered and printed "
                                     "(program_for_rank, `mambac dump --world-size`) but not run; "
                                     + launch_hint(self.options.world_size) + ".")
        if knobs().debug:
            from mambac.runtime.checkpoint import check_same_inputs
            check_same_inputs(values, self.mesh.rank)
        length = None
        if self.options.cp > 1:
            values, length = self._cp_inputs(values)
        self.__dict__["_mambac_current"] = self._program(values, length)  # lower before DDP's hooks run
        try:
            ddp = self.__dict__["_mambac_ddp"]
            return ddp(*values) if ddp is not None else self._run_values(values)
        finally:
            self.__dict__["_mambac_current"] = None

    def _cp_inputs(self, values: list[Any]) -> tuple[list[Any], int]:
        """This rank's pieces of the sequence inputs and the whole length (context parallelism)."""
        from mambac.lowering import cp_pieces, sequence_length
        spec = self.mesh.spec
        if self.options.cp_inputs == "full":
            return cp_pieces(values, spec.cp_rank, spec.cp)
        import torch.distributed as dist
        from mambac.runtime.collectives import split_sizes
        mine = torch.tensor([sequence_length(values)], dtype=torch.int64,
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
        every = [torch.zeros_like(mine) for _ in range(spec.cp)]
        dist.all_gather(every, mine, group=self.mesh.cp_group)
        lengths = [int(t.item()) for t in every]
        if lengths != split_sizes(sum(lengths), spec.cp):
            raise MambacInputError(
                f"cp_inputs='local': the cp ranks passed pieces of {lengths} tokens; mambac expects pieces in rank "
                f"order of {split_sizes(sum(lengths), spec.cp)} for a sequence of {sum(lengths)} (the first ranks one "
                "longer when cp does not divide the length). Cut the sequence that way, or pass the whole sequence "
                "with cp_inputs='full'.")
        return values, sum(lengths)

    # ---- unsharded state dicts --------------------------------------------------------------

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False):
        if self.options.world_size == 1:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        from mambac.runtime.checkpoint import full_state_dict
        out = full_state_dict(self)
        if destination is None:
            return {prefix + k: v for k, v in out.items()}
        destination.update({prefix + k: v for k, v in out.items()})
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if self.options.world_size == 1:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        from mambac.runtime.checkpoint import load_full_state_dict
        return load_full_state_dict(self, state_dict, strict=strict)

    def lowered_graph_text(self, stage: str = "") -> str:
        """Printed graph after ``stage`` (the last pass when empty) of the first lowered program."""
        if not self.programs:
            raise RuntimeError("nothing lowered yet: call the module (or mambac.compile with example_inputs) first")
        history = next(iter(self.programs.values())).ctx.history
        if not stage:
            return history[-1][1]
        for name, text in history:
            if name == stage:
                return text
        raise KeyError(f"no stage {stage!r}; stages: {[n for n, _ in history]}")

    def extra_repr(self) -> str:
        return f"mambac {self.options}"


def _rebuild(model: torch.nn.Module, options: CompileOptions,
             check_inputs: Callable[[list[Any]], None] | None,
             source: torch.nn.Module | None = None) -> CompiledModule:
    """A pickled ``CompiledModule`` (one rank), back from its model, options and source model."""
    return CompiledModule(model, options, check_inputs, source)
