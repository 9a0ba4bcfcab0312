"""transformers' Mamba / Mamba-2 mixers inside a dynamo graph, swapped for mambac's own mixers.

Dynamo traces an HF ``MambaMixer`` / ``Mamba2Mixer`` into plain PyTorch nodes, which hold nothing
``fuse_ssm`` can fold.  The graph alone lacks each mixer's configuration (chunk size, time-step
limits, norm epsilon, groups), but the module dynamo compiles is reachable from the frame it is
compiling, and the nodes' ``nn_module_stack`` names the path of the mixer each came from.  So for
every mixer region (the nodes whose module stack holds that mixer), this module:

1. resolves the live HF mixer from the frame's locals and checks the region is its whole forward:
   one tensor in (``hidden_states``), one tensor out (``out_proj``'s), every parameter of the
   mixer read inside, no graph break inside its ``forward``, no other tensor input (a cache or an
   attention mask that is not None);
2. converts it (``mambac.convert.hf.convert_mixer``: mambac's ``Mamba`` / ``Mamba2`` on the same
   parameter tensors), captures that with ``mambac.capture.trace`` and keeps it on the dynamo
   ``GraphModule`` (attribute ``mambac_mixer_<i>``);
3. replaces the region by the captured graph, reading each parameter from the graph input dynamo
   lifted it to (so gradients land on the HF parameters, as dynamo's own nodes do).

The pass pipeline then fuses these mixers exactly as under ``mambac.compile(convert(model))``.
A region that cannot be swapped safely is left as it is (it runs HF's own PyTorch code) and the
reason is logged at warning level.  One rank only: on several ranks the backend lowers the model
behind the graph instead (``mambac.backend_parallel``).
"""
from __future__ import annotations

import inspect
import logging
import re
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx
import torch.nn as nn

from mambac.dynamo_paths import dotted, qualname
from mambac.errors import MambacError
from mambac.ir import SOURCE, SourceInfo

log = logging.getLogger("mambac.backend")

HF_MIXERS = ("transformers.models.mamba.modeling_mamba.MambaMixer",
             "transformers.models.mamba2.modeling_mamba2.Mamba2Mixer")
SUBMODULE_PREFIX = "mambac_mixer_"


class Refused(Exception):
    """Why one region is left as it is."""


@dataclass
class Region:
    """The nodes of one HF mixer in a dynamo graph (placeholders excluded) and its module stack."""

    raw_path: str                      # dynamo's path, e.g. L['self'].backbone.layers[0].mixer
    cls: str                           # qualified class name
    stack: dict = field(default_factory=dict)   # nn_module_stack entries down to the mixer
    nodes: list[torch.fx.Node] = field(default_factory=list)


def find_regions(gm: torch.fx.GraphModule, classes: Sequence[str] = HF_MIXERS) -> dict[str, Region]:
    """Regions of the modules of ``classes`` (HF mixers by default) in ``gm`` by dynamo module
    path, in graph order."""
    regions: dict[str, Region] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        prefix = {}
        for key, (path, cls) in (node.meta.get("nn_module_stack") or {}).items():
            prefix[key] = (path, cls)
            if qualname(cls) in classes:
                region = regions.setdefault(path, Region(path, qualname(cls), dict(prefix)))
                region.nodes.append(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for region in regions.values():
        _absorb_unmarked(gm, region, order)
    return regions


def _absorb_unmarked(gm: torch.fx.GraphModule, region: Region, order: dict) -> None:
    """Add to ``region`` the nodes between its first and last that dynamo left without a module
    stack but that read nothing from outside it (e.g. ``_vmap_decrement_nesting`` closing a
    ``vmap`` the mixer opened): they belong to the mixer's code."""
    inside = set(region.nodes)
    first, last = order[region.nodes[0]], order[region.nodes[-1]]
    for node in gm.graph.nodes:
        if first < order[node] < last and node not in inside and node.op == "call_function" \
                and not node.meta.get("nn_module_stack") and all(a in inside for a in node.all_input_nodes):
            inside.add(node)
    region.nodes = sorted(inside, key=order.__getitem__)


# -- the live module behind a path -------------------------------------------------------------------

_ROOT = re.compile(r"^L\['([^']+)'\]((?:\[\d+\]|\['[^']*'\])*)")


def resolve(raw_path: str, f_locals: dict) -> nn.Module | None:
    """The object at dynamo module path ``raw_path`` (``L['args'][0].backbone.layers.0.mixer``)
    among the compiled frame's locals, or None when the path does not lead to a module."""
    match = _ROOT.match(raw_path)
    if match is None or match.group(1) not in f_locals:
        return None
    obj: Any = f_locals[match.group(1)]
    try:
        for index in re.findall(r"\[(\d+|'[^']*')\]", match.group(2)):
            obj = obj[index.strip("'")] if index.startswith("'") else obj[int(index)]
        rest = dotted(raw_path[match.end():])
        return obj.get_submodule(rest) if rest else obj
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def _compiling_frame():
    from mambac.backend_parallel import _current_frame
    return _current_frame()


# -- checks ----------------------------------------------------------------------------------------

def node_value(node: torch.fx.Node) -> Any:
    return node.meta.get("val", node.meta.get("example_value"))


def param_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], region: Region,
                 mixer: nn.Module) -> tuple[dict[str, torch.fx.Node], list[torch.fx.Node]]:
    """The mixer's parameters among the region's inputs (name → graph node) and its other tensor
    inputs; anything else coming in (sizes) is ignored."""
    by_id = {id(p): name for name, p in mixer.named_parameters(remove_duplicate=False)}
    by_path = {f"{dotted(region.raw_path)}.{name}": name for name in by_id.values()}
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    inside = set(region.nodes)
    params: dict[str, torch.fx.Node] = {}
    others: list[torch.fx.Node] = []
    for node in region.nodes:
        for inp in node.all_input_nodes:
            if inp in inside or inp in params.values() or inp in others:
                continue
            name = None
            if inp.op == "placeholder":
                i = placeholders[inp]
                real = example_inputs[i] if i < len(example_inputs) else None
                name = by_id.get(id(real)) if isinstance(real, torch.Tensor) else None
                arg = inp.meta.get("grapharg")
                source = getattr(getattr(arg, "source", None), "name", "")
                if name is None and source:
                    name = by_path.get(dotted(re.sub(r"\._(modules|parameters)\['([^']*)'\]", r".\2", source)))
            elif inp.op == "get_attr":
                name = by_id.get(id(getattr(gm, str(inp.target), None)))
            if name is not None:
                params[name] = inp
            elif isinstance(node_value(inp), torch.Tensor):
                others.append(inp)
    return params, others


def check_no_break_inside(gm: torch.fx.GraphModule, module: nn.Module) -> None:
    """``Refused`` when dynamo broke the graph inside ``module``'s forward."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    if reason is not None and reason.graph_break and code is not None:
        if any(f.filename == code.co_filename and f.name == code.co_name for f in reason.user_stack or ()):
            raise Refused("dynamo broke the graph inside its forward, so the graph holds part of it")


def _check_region(gm: torch.fx.GraphModule, region: Region, mixer: nn.Module, params: dict,
                  others: list) -> tuple[torch.fx.Node, torch.fx.Node]:
    """(hidden_states input, output node) of a region that is the mixer's whole forward, else
    ``Refused`` with the reason."""
    check_no_break_inside(gm, mixer)
    if len(others) != 1:
        names = ", ".join(n.name for n in others) or "none"
        raise Refused(f"its forward got {len(others)} tensor input(s) besides its parameters ({names}); only "
                      "hidden_states is supported (a cache or an attention mask that is not None is not; "
                      "transformers 5 builds a generation cache for each call not made with use_cache=False, "
                      "and training needs none)")
    missing = sorted(set(n for n, _ in mixer.named_parameters()) - set(params))
    if missing:
        raise Refused(f"the graph holds part of its forward only (parameters {missing} are not read in it)")
    inside = set(region.nodes)
    # sizes computed inside may be used again outside (dynamo shares symbolic sizes); they stay
    outs = [n for n in region.nodes if any(u not in inside for u in n.users) and not size_like(node_value(n))]
    if len(outs) != 1:
        raise Refused(f"{len(outs)} of its values are used outside it; exactly one (its output) is supported")
    for node in region.nodes:
        if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_") \
                and node.args and node.args[0] not in inside:
            raise Refused(f"it changes a value from outside in place ({node.format_node()})")
    out, hidden = outs[0], others[0]
    stack = list((out.meta.get("nn_module_stack") or {}).values())
    if not stack or dotted(stack[-1][0]) != f"{dotted(region.raw_path)}.out_proj":
        raise Refused("its value used outside is not its out_proj's output")
    h, y = node_value(hidden), node_value(out)
    d_model = int(mixer.hidden_size)
    if not (isinstance(h, torch.Tensor) and isinstance(y, torch.Tensor) and h.dim() == 3 and y.dim() == 3
            and h.shape[-1] == d_model and y.shape[-1] == d_model):
        raise Refused(f"its input and output are not (batch, length, {d_model}) tensors")
    return hidden, out


def size_like(value: Any) -> bool:
    """A value that holds no tensor (a size, a SymInt, a shape tuple)."""
    from torch.utils import _pytree as pytree
    return value is not None and not any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(value))


# -- the swap ----------------------------------------------------------------------------------------

def _inline(gm: torch.fx.GraphModule, captured: torch.fx.GraphModule, name: str, region: Region,
            params: dict[str, torch.fx.Node], key_map: dict, hidden: torch.fx.Node, out: torch.fx.Node) -> None:
    """Put ``captured``'s nodes before ``out``, reading parameters from ``params`` (HF name → node)
    where dynamo lifted them, from the registered submodule otherwise; ``out``'s users take the
    result and the region's nodes are erased."""
    graph, env = gm.graph, {}
    path = dotted(region.raw_path)

    def param(key: str) -> torch.fx.Node:
        node = params.get(key_map.get(key, key))
        return node if node is not None else graph.get_attr(f"{name}.{key}")

    result = None
    with graph.inserting_before(out):
        for node in captured.graph.nodes:
            if node.op == "placeholder":
                env[node] = hidden
                continue
            if node.op == "output":
                result = env[node.args[0]]
                continue
            if node.op == "get_attr":
                new = param(str(node.target))
            elif node.op == "call_module" and isinstance(captured.get_submodule(str(node.target)), nn.Linear):
                linear = captured.get_submodule(str(node.target))
                bias = param(f"{node.target}.bias") if linear.bias is not None else None
                new = graph.call_function(torch._C._nn.linear,
                                          (env[node.args[0]], param(f"{node.target}.weight"), bias))
            elif node.op == "call_module":
                new = graph.call_module(f"{name}.{node.target}", tuple(env[a] for a in node.args))
            else:
                new = graph.node_copy(node, lambda n: env[n])
            src = node.meta.get(SOURCE)
            sub = src.module_path if src is not None else ""
            if node.op == "call_module":
                sub = str(node.target)
            new.meta["nn_module_stack"] = dict(region.stack)
            new.meta[SOURCE] = SourceInfo(module_path=f"{path}.{sub}" if sub else path,
                                          module_type=src.module_type if src is not None and src.module_type
                                          else type(captured).__name__.removesuffix("Graph"))
            env[node] = new
    out.replace_all_uses_with(result)
    inside = set(region.nodes)
    for node in reversed(list(graph.nodes)):
        if node in inside and not node.users:
            graph.erase_node(node)


def _swap_one(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], region: Region, f_locals: dict,
              index: int) -> None:
    from mambac.capture import trace
    from mambac.convert.hf import convert_mixer

    mixer = resolve(region.raw_path, f_locals)
    if mixer is None or qualname(type(mixer)) != region.cls:
        raise Refused("the module at that path is not reachable from the frame dynamo compiled")
    params, others = param_inputs(gm, example_inputs, region, mixer)
    hidden, out = _check_region(gm, region, mixer, params, others)
    try:
        conv = convert_mixer(mixer)
        captured = trace(conv.model, 1)
    except MambacError as exc:
        raise Refused(f"mambac cannot convert it: {exc}") from exc
    name = f"{SUBMODULE_PREFIX}{index}"
    # An attribute of the GraphModule, not a registered submodule: its parameters are the HF ones,
    # which dynamo already passes as graph inputs, and AOTAutograd (trace_backward) requires every
    # parameter of the GraphModule to be one of dynamo's.  get_attr / call_module still reach it.
    gm.__dict__[name] = conv.model
    _inline(gm, captured, name, region, params, dict(conv.key_map), hidden, out)


_WARNED_CHECKPOINTING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def hf_checkpointing(model: Any) -> bool:
    """Whether a transformers model has gradient (activation) checkpointing on: the newer flag's
    name first, then the older one's (deprecated since transformers 5.2x, read without its warning)."""
    if not isinstance(model, nn.Module):
        return False
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            value = getattr(model, name, None)
        if isinstance(value, bool):
            return value
    return False


def warn_if_gradient_checkpointing() -> bool:
    """Say once per model when the module dynamo compiles has transformers' gradient checkpointing
    on: its wrapper breaks the graph around every layer, so no mixer reaches mambac (each runs
    transformers' own PyTorch code, and nothing is fused).  Returns whether it is on."""
    tx = _compiling_frame()
    model = (getattr(tx, "f_locals", None) or {}).get("self")
    if not hf_checkpointing(model):
        return False
    if model not in _WARNED_CHECKPOINTING:
        _WARNED_CHECKPOINTING.add(model)
        log.warning("mambac backend: %s has gradient checkpointing on; transformers' checkpoint wrapper breaks "
                    "dynamo's graph around every layer, so its mixers run transformers' own PyTorch code, unfused. "
                    "Call model.gradient_checkpointing_disable() and pass options={'remat': 'full'} (or 'auto') "
                    "for the same recompute with mambac's kernels.", type(model).__name__)
    return True


def swap_foreign_mixers(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> int:
    """Replace every HF mixer region of ``gm`` that can be replaced safely by mambac's captured
    mixer (module docstring), and the HF Mamba RMSNorms of a graph that holds mixers by
    ``add_rmsnorm`` (``mambac.backend_norms``); returns how many regions were replaced.  The
    mixers that stay are logged."""
    regions = find_regions(gm)
    if not regions:
        return 0
    tx = _compiling_frame()
    f_locals = getattr(tx, "f_locals", None) or {}
    swapped = 0
    for region in regions.values():
        try:
            if not f_locals:
                raise Refused("the model dynamo compiles is not reachable from the backend")
            _swap_one(gm, example_inputs, region, f_locals, swapped)
            swapped += 1
        except Refused as why:
            log.warning("mambac backend: %s at '%s' is not lowered and runs as its own PyTorch code: %s.",
                        region.cls.rsplit(".", 1)[-1], dotted(region.raw_path), why)
    if f_locals:  # after the mixers: a mixer region's input is the norm's output node
        from mambac.backend_norms import swap_foreign_norms
        swapped += swap_foreign_norms(gm, example_inputs, f_locals)
    if swapped:
        gm.graph.lint()
        gm.recompile()
    return swapped
