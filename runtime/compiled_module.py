"""The compiled module: the user's model, with its forward replaced by lowered programs.

It shares the model's submodules, parameters and buffers (the same objects), so ``state_dict()``
keys, ``parameters()``, optimizers, ``.to()`` and ``load_state_dict`` behave exactly as on the
original model, and gradients land on the original parameters.  One program is lowered per forward
signature (which optional arguments are given) on first use and cached.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from mambac.lowering import Lowered, bind_inputs, lower, signature_of
from mambac.options import CompileOptions

log = logging.getLogger("mambac.runtime")


class CompiledModule(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, options: CompileOptions,
                 check_inputs: Callable[[list[Any]], None] | None = None) -> None:
        super().__init__()
        # Share the model's module tree instead of wrapping it: same keys, same Parameter objects.
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self.__dict__["_mambac_model"] = model
        self.__dict__["_mambac_options"] = options
        self.__dict__["_mambac_programs"] = {}
        self.__dict__["_mambac_check_inputs"] = check_inputs

    @property
    def original_module(self) -> torch.nn.Module:
        return self.__dict__["_mambac_model"]

    @property
    def options(self) -> CompileOptions:
        return self.__dict__["_mambac_options"]

    @property
    def programs(self) -> dict[tuple[bool, ...], Lowered]:
        """The lowered programs, one per forward signature seen so far."""
        return self.__dict__["_mambac_programs"]

    def program_for(self, *args: Any, **kwargs: Any) -> Lowered:
        """Lower (or fetch) the program for this call's signature without running it."""
        values = bind_inputs(self.original_module, args, kwargs)
        key = signature_of(values)
        if key not in self.programs:
            log.info("lowering %s for signature %s", type(self.original_module).__name__, key)
            self.programs[key] = lower(self.original_module, values, self.options)
        return self.programs[key]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = bind_inputs(self.original_module, args, kwargs)
        check = self.__dict__["_mambac_check_inputs"]
        if check is not None:
            check(values)
        program = self.program_for(*args, **kwargs)
        return program.gm(*values)

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
