"""Compile-and-load of generated kernels as an ordered table of named stages.

    render -> write -> import -> autotune

``load_kernel`` runs the first three (render the source, store it in the on-disk cache under
its content hash, import it as a module); ``autotune`` runs per shape bucket at the first launch
(``mambac.codegen.autotune``).  Every artefact stays on disk.  When a stage fails, a
``repro.py`` that re-runs just that stage is written next to the artefacts and its path is in the
raised ``CodegenError``, so a failing kernel can be debugged without the rest of mambac.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

import torch

from mambac.errors import MambacError
from mambac.knobs import knobs
from mambac.codegen import cache
from mambac.codegen.autotune import interpreting
from mambac.codegen.direct_launch import DirectLaunches
from mambac.codegen.kernel_ir import TileConfig

STAGES = ("render", "write", "import", "autotune")


class CodegenError(MambacError, RuntimeError):
    """A generated kernel failed to render, import, tune or launch; the message names a repro."""


@dataclass
class CompiledKernel:
    """A generated kernel that rendered, was stored and imported."""

    name: str
    source: str
    path: Path
    module: ModuleType
    stage_log: list[str] = field(default_factory=list)
    direct: Optional[DirectLaunches] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not interpreting() and hasattr(self.module, self.name):
            self.direct = DirectLaunches(self.fn)

    @property
    def fn(self) -> Any:
        return getattr(self.module, self.name)

    @property
    def source_hash(self) -> str:
        return cache.content_hash(self.source)

    def launch(self, grid: tuple[int, ...], args: Sequence[Any], constexprs: dict[str, int],
               cfg: TileConfig) -> None:
        """Run the kernel with ``cfg``'s launch options; on failure write a launch repro and raise
        ``CodegenError``."""
        options = cfg.launch_options()
        try:
            if self.direct is None or not knobs().direct_launch:
                self.fn[grid](*args, **constexprs, **options)
            else:
                self.direct.launch(grid, args, constexprs, options,
                                   lambda: self.fn[grid](*args, **constexprs, **options))
        except Exception as exc:
            repro = write_launch_repro(self, grid, args, constexprs, options)
            raise CodegenError(f"launch of generated kernel {self.name} failed: {exc!r}\n"
                               f"  source: {self.path}\n  repro:  python {repro}") from exc


_MODULES: dict[Path, ModuleType] = {}
_LOADED: dict[tuple[str, str], CompiledKernel] = {}


def _import_file(path: Path) -> ModuleType:
    """Import a generated file as a module (once per process and path)."""
    if path in _MODULES:
        return _MODULES[path]
    mod_name = f"mambac_generated.{path.parent.name.replace('-', '_')}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    _MODULES[path] = module
    return module


def load_kernel(name: str, render: Callable[[], str], describe: str = "") -> CompiledKernel:
    """Run render -> write -> import for kernel ``name``; see the module docstring.

    A source already loaded in this process is returned from memory (no disk access), which
    keeps the per-launch cost of the generated kernels to a dictionary lookup.
    """
    log: list[str] = []
    source = _stage("render", name, describe, log, render, None)
    if (name, source) in _LOADED:
        return _LOADED[(name, source)]
    path = _stage("write", name, describe, log, lambda: cache.write_source(name, source), source)
    module = _stage("import", name, describe, log, lambda: _import_file(path), source)
    if not hasattr(module, name):
        raise CodegenError(f"generated module {path} defines no kernel named {name!r}")
    kernel = CompiledKernel(name=name, source=source, path=path, module=module, stage_log=log)
    _LOADED[(name, source)] = kernel
    return kernel


def _stage(stage: str, name: str, describe: str, log: list[str], fn: Callable[[], Any],
           source: str | None) -> Any:
    try:
        out = fn()
    except Exception as exc:
        repro = write_stage_repro(stage, name, source, traceback.format_exc())
        raise CodegenError(f"stage '{stage}' of generated kernel {name} ({describe}) failed: {exc!r}\n"
                           f"  repro: python {repro}") from exc
    log.append(stage)
    return out


def _artefact_dir(name: str, source: str | None) -> Path:
    if source is None:
        return Path(tempfile.mkdtemp(prefix=f"mambac-{name}-"))
    d = cache.kernel_dir(name, source)
    d.mkdir(parents=True, exist_ok=True)
    return d


def write_stage_repro(stage: str, name: str, source: str | None, tb: str) -> Path:
    """A script that repeats a failed render/write/import stage on its own."""
    d = _artefact_dir(name, source)
    if source is None:
        body = (f"# rendering {name} failed before any source existed; the traceback was:\n"
                + "".join(f"# {ln}\n" for ln in tb.splitlines()) + "raise SystemExit(1)\n")
    else:
        body = ("import importlib.util, pathlib\n"
                "path = pathlib.Path(__file__).with_name('kernel.py')\n"
                "spec = importlib.util.spec_from_file_location('kernel', path)\n"
                "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
                f"print('imported', path, 'fine: the {stage} stage no longer fails')\n")
    path = d / "repro.py"
    cache.write_atomic(path, f"# repro of stage '{stage}' of generated kernel {name}\n" + body)
    return path


def _describe_arg(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return (f"_tensor({tuple(a.shape)}, {tuple(a.stride())}, {str(a.dtype)}, "
                f"device)")
    return repr(a)


def write_launch_repro(kernel: CompiledKernel, grid: tuple[int, ...], args: Sequence[Any],
                       constexprs: dict[str, int], options: dict[str, int]) -> Path:
    """A script that launches the kernel alone with random inputs of the failing layout."""
    arg_text = ",\n    ".join(_describe_arg(a) for a in args)
    body = f'''# repro of a failed launch of generated kernel {kernel.name}
import importlib.util, pathlib
import torch

device = "cuda" if torch.cuda.is_available() else "cpu"


def _tensor(shape, stride, dtype, device):
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if shape else 1
    base = torch.randn(size, device=device).to(dtype)
    return torch.as_strided(base, shape, stride)


path = pathlib.Path(__file__).with_name("kernel.py")
spec = importlib.util.spec_from_file_location("kernel", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
args = [
    {arg_text},
]
mod.{kernel.name}[{grid!r}](*args, **{constexprs!r}, **{options!r})
print("launch finished")
'''
    path = kernel.path.with_name("repro.py")
    cache.write_atomic(path, body)
    return path
