"""The sharding plan: which module is split how across the tensor-parallel ranks.

The default is the Megatron layout for Mamba models: every mixer (Mamba-1, -2, -3) and gated MLP
column-parallel into its inner width and row-parallel out of it, the embedding and the LM head split
over the vocabulary.  Users override it by module path: ``plan={"backbone.layers.1.mixer":
"replicate"}`` (kinds: ``KINDS``).

For one rank, the plan gives every parameter a ``ParamLayout``: the tensor dim that is split and
the segments (``mambac.ir.Segment``) this rank holds, in local order.  Mamba-2's in_proj, for
instance, is split *by segment* so that each rank's rows hold its own heads' z, x and dt and its
groups' B and C (B and C are replicated when tp does not divide ngroups).  Head counts tp does not
divide are split unevenly, the first ranks taking one more head.  ``local_model`` builds the
rank's module: the same classes and parameter names with parameters cut to the local shards and
the mixers' size attributes (nheads, ngroups, d_ssm, ...) set to the local ones, so a capture of it
has the local shapes.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from mambac.errors import MambacConfigError, MambacOptionsError
from mambac.ir import Segment
from mambac.runtime.collectives import split_sizes, split_start

KINDS = ("auto", "replicate", "mamba1", "mamba2", "mamba3", "mlp", "vocab_embedding", "vocab_head")


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is split: along ``dim``, this rank holding ``segments`` (in order)."""

    dim: int
    segments: tuple[Segment, ...]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the unsharded tensor ``full``."""
        pieces, offset = [], 0
        for s in self.segments:
            pieces.append(full.narrow(self.dim, offset + s.start, s.size))
            offset += s.total
        if offset != full.shape[self.dim]:
            raise MambacConfigError(f"layout covers {offset} entries of dim {self.dim}, the tensor has "
                                    f"{full.shape[self.dim]}.")
        return torch.cat(pieces, self.dim)

    def global_index(self) -> list[int]:
        """For each local entry along ``dim``, its index in the unsharded tensor."""
        out, offset = [], 0
        for s in self.segments:
            out.extend(range(offset + s.start, offset + s.start + s.size))
            offset += s.total
        return out

    def owned_index(self, tp_rank: int) -> list[int]:
        """Local entries this rank owns for norms and checkpoints: all of its sharded segments,
        replicated segments only on tp rank 0 (so each entry is counted once)."""
        out, pos = [], 0
        for s in self.segments:
            if not s.replicated or tp_rank == 0:
                out.extend(range(pos, pos + s.size))
            pos += s.size
        return out


def even(name: str, total: int, tp: int, rank: int, unit: int = 1) -> Segment:
    """``total`` items of ``unit`` entries each, split evenly (first ranks one more item)."""
    n = split_sizes(total, tp)[rank]
    return Segment(name, split_start(total, tp, rank) * unit, n * unit, total * unit)


def whole(name: str, total: int) -> Segment:
    return Segment(name, 0, total, total)


@dataclass
class ModuleShards:
    """One module's share of the plan: its parameters' layouts and its local size attributes."""

    params: dict[str, ParamLayout] = field(default_factory=dict)
    attrs: dict[str, object] = field(default_factory=dict)
    linear_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)  # submodule -> (in, out)


def _heads(mod: nn.Module, tp: int, rank: int, what: str) -> tuple[int, int]:
    h = mod.nheads
    if h < tp:
        raise MambacConfigError(f"{what} has {h} heads, fewer than tp={tp}: every rank needs at least one "
                                "head. Use a smaller tp or replicate this module (plan={path: 'replicate'}).")
    return split_start(h, tp, rank), split_sizes(h, tp)[rank]


def _groups(g: int, tp: int, rank: int) -> tuple[int, int, bool]:
    """(first group, local count, sharded?): split when tp divides ngroups, else replicated."""
    if g % tp == 0:
        return rank * (g // tp), g // tp, True
    return 0, g, False


def mamba2_shards(mod: nn.Module, tp: int, rank: int) -> ModuleShards:
    hs, hn = _heads(mod, tp, rank, "Mamba2")
    p, n, g = mod.headdim, mod.d_state, mod.ngroups
    gs, gn, _ = _groups(g, tp, rank)
    d_mlp = mod.d_inner - mod.d_ssm
    mlp = even("mlp", d_mlp, tp, rank)
    heads = lambda name, unit: Segment(name, hs * unit, hn * unit, mod.nheads * unit)  # noqa: E731
    grp = lambda name: Segment(name, gs * n, gn * n, g * n)  # noqa: E731
    in_rows = (Segment("z0", mlp.start, mlp.size, d_mlp), Segment("x0", mlp.start, mlp.size, d_mlp),
               heads("z", p), heads("x", p), grp("B"), grp("C"), heads("dt", 1))
    conv = (heads("x", p), grp("B"), grp("C"))
    sh = ModuleShards()
    sh.params = {"in_proj.weight": ParamLayout(0, in_rows), "in_proj.bias": ParamLayout(0, in_rows),
                 "conv1d.weight": ParamLayout(0, conv), "conv1d.bias": ParamLayout(0, conv),
                 "dt_bias": ParamLayout(0, (heads("h", 1),)), "A_log": ParamLayout(0, (heads("h", 1),)),
                 "D": ParamLayout(0, (heads("h", p if mod.D_has_hdim else 1),)),
                 "norm.weight": ParamLayout(0, (heads("x", p),)),
                 "out_proj.weight": ParamLayout(1, (Segment("mlp", mlp.start, mlp.size, d_mlp), heads("y", p)))}
    d_ssm = hn * p
    sh.attrs = {"nheads": hn, "ngroups": gn, "d_ssm": d_ssm, "d_inner": mlp.size + d_ssm}
    sh.linear_sizes = {"in_proj": (mod.d_model, sum(s.size for s in in_rows)),
                       "out_proj": (mlp.size + d_ssm, mod.d_model),
                       "conv1d": (sum(s.size for s in conv),) * 2}
    return sh


def mamba1_shards(mod: nn.Module, tp: int, rank: int) -> ModuleShards:
    d = mod.d_inner
    ch = lambda name: even(name, d, tp, rank)  # noqa: E731
    sh = ModuleShards()
    sh.params = {"in_proj.weight": ParamLayout(0, (ch("x"), ch("z"))), "in_proj.bias": ParamLayout(0, (ch("x"), ch("z"))),
                 "conv1d.weight": ParamLayout(0, (ch("x"),)), "conv1d.bias": ParamLayout(0, (ch("x"),)),
                 "x_proj.weight": ParamLayout(1, (ch("x"),)),
                 "dt_proj.weight": ParamLayout(0, (ch("x"),)), "dt_proj.bias": ParamLayout(0, (ch("x"),)),
                 "A_log": ParamLayout(0, (ch("x"),)), "D": ParamLayout(0, (ch("x"),)),
                 "out_proj.weight": ParamLayout(1, (ch("y"),))}
    local = ch("x").size
    if local == 0:
        raise MambacConfigError(f"Mamba: d_inner={d} is smaller than tp={tp}.")
    sh.attrs = {"d_inner": local}
    sh.linear_sizes = {"in_proj": (mod.d_model, 2 * local), "x_proj": (local, mod.x_proj.out_features),
                       "dt_proj": (mod.dt_rank, local), "out_proj": (local, mod.d_model), "conv1d": (local, local)}
    return sh


def mamba3_shards(mod: nn.Module, tp: int, rank: int) -> ModuleShards:
    hs, hn = _heads(mod, tp, rank, "Mamba3")
    p, n, g, r = mod.headdim, mod.d_state, mod.ngroups, mod.mimo_rank
    gs, gn, _ = _groups(g, tp, rank)
    heads = lambda name, unit: Segment(name, hs * unit, hn * unit, mod.nheads * unit)  # noqa: E731
    bc = lambda name: tuple(Segment(f"{name}{i}", gs * n, gn * n, g * n) for i in range(r))  # noqa: E731
    rows = (heads("z", p), heads("x", p)) + bc("B") + bc("C") + (heads("dt", 1), heads("A", 1), heads("trap", 1),
                                                                  whole("angles", mod.num_rope_angles))
    per_head = ParamLayout(0, (heads("h", 1),))
    sh = ModuleShards()
    sh.params = {"in_proj.weight": ParamLayout(0, rows), "dt_bias": per_head, "B_bias": per_head,
                 "C_bias": per_head, "D": per_head, "mimo_x": per_head, "mimo_z": per_head, "mimo_o": per_head,
                 "norm.weight": ParamLayout(0, (heads("y", p),)), "out_proj.weight": ParamLayout(1, (heads("y", p),))}
    sh.attrs = {"nheads": hn, "ngroups": gn, "num_bc_heads": gn, "d_inner": hn * p}
    sh.linear_sizes = {"in_proj": (mod.d_model, sum(s.size for s in rows)), "out_proj": (hn * p, mod.d_model)}
    return sh


def mlp_shards(mod: nn.Module, tp: int, rank: int) -> ModuleShards:
    hidden = mod.fc2.in_features
    y, gate = even("y", hidden, tp, rank), even("gate", hidden, tp, rank)
    sh = ModuleShards()
    sh.params = {"fc1.weight": ParamLayout(0, (y, gate)), "fc1.bias": ParamLayout(0, (y, gate)),
                 "fc2.weight": ParamLayout(1, (y,))}
    sh.linear_sizes = {"fc1": (mod.fc1.in_features, 2 * y.size), "fc2": (y.size, mod.fc2.out_features)}
    return sh


def vocab_shards(mod: nn.Module, tp: int, rank: int) -> ModuleShards:
    v = mod.weight.shape[0]
    seg = even("vocab", v, tp, rank)
    sh = ModuleShards(params={"weight": ParamLayout(0, (seg,))})
    if isinstance(mod, nn.Linear):
        if mod.bias is not None:
            sh.params["bias"] = ParamLayout(0, (seg,))
        sh.linear_sizes = {"": (mod.in_features, seg.size)}
    else:
        sh.attrs = {"num_embeddings": seg.size}
    return sh


SHARDERS: dict[str, Callable[[nn.Module, int, int], ModuleShards]] = {
    "mamba1": mamba1_shards, "mamba2": mamba2_shards, "mamba3": mamba3_shards, "mlp": mlp_shards,
    "vocab_embedding": vocab_shards, "vocab_head": vocab_shards,
}


def default_kind(path: str, mod: nn.Module) -> str:
    """The Megatron layout: which kind a module gets when the plan does not name it."""
    name = type(mod).__name__
    table = {"Mamba": "mamba1", "Mamba2": "mamba2", "Mamba3": "mamba3", "GatedMLP": "mlp"}
    if name in table:
        return table[name]
    if isinstance(mod, nn.Embedding) and path.endswith("embedding"):
        return "vocab_embedding"
    if isinstance(mod, nn.Linear) and path == "lm_head":
        return "vocab_head"
    return "replicate"


@dataclass
class RankPlan:
    """The plan for one rank: module kinds, parameter layouts, local attributes."""

    tp: int
    tp_rank: int
    kinds: dict[str, str]
    modules: dict[str, ModuleShards]
    params: dict[str, ParamLayout]          # full parameter name -> layout (absent: replicated)

    def layout_of(self, name: str) -> ParamLayout | None:
        return self.params.get(name)


def _kinds(model: nn.Module, overrides: dict[str, str]) -> dict[str, str]:
    paths = dict(model.named_modules())
    for path, kind in overrides.items():
        if path not in paths:
            raise MambacOptionsError(f"plan names module '{path}', which the model does not have.")
        if kind not in KINDS:
            raise MambacOptionsError(f"plan kind for '{path}' is {kind!r}; choose one of {list(KINDS)}.")
    kinds: dict[str, str] = {}
    covered: list[str] = []
    for path, mod in paths.items():
        if any(path.startswith(c + ".") for c in covered):
            continue  # inside a module that is already split as a whole
        kind = overrides.get(path, "auto")
        kind = default_kind(path, mod) if kind == "auto" else kind
        if kind != "replicate":
            kinds[path] = kind
            covered.append(path)
        elif path in overrides:
            covered.append(path)
    return kinds


def make_plan(model: nn.Module, tp: int, tp_rank: int, overrides: dict[str, str] | None = None) -> RankPlan:
    """The plan for ``tp_rank`` of ``tp``: the default Megatron layout plus ``overrides``."""
    kinds = _kinds(model, dict(overrides or {})) if tp > 1 else {}
    modules, params = {}, {}
    by_id: dict[int, tuple[str, ParamLayout]] = {}
    for path, kind in kinds.items():
        mod = model.get_submodule(path)
        sh = SHARDERS[kind](mod, tp, tp_rank)
        modules[path] = sh
        for local_name, layout in sh.params.items():
            try:
                p = mod.get_parameter(local_name)
            except AttributeError:
                continue  # optional parameter absent (bias=False, no MIMO, no norm)
            full = f"{path}.{local_name}" if path else local_name
            prev = by_id.get(id(p))
            if prev is not None and prev[1] != layout:
                raise MambacOptionsError(f"parameter '{full}' is shared with '{prev[0]}' but the plan splits "
                                         "them differently (tied weights need one layout).")
            by_id[id(p)] = (full, layout)
            params[full] = layout
    _check_tied(model, by_id, dict(overrides or {}))
    return RankPlan(tp=tp, tp_rank=tp_rank, kinds=kinds, modules=modules, params=params)


def _check_tied(model: nn.Module, by_id: dict, overrides: dict[str, str]) -> None:
    """A parameter shared with a module the plan replicates cannot also be split."""
    kept = [path for path, kind in overrides.items() if kind == "replicate"]
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if id(p) in by_id and any(owner == k or owner.startswith(k + ".") for k in kept):
            raise MambacOptionsError(f"parameter '{name}' is shared with '{by_id[id(p)][0]}' but the plan splits "
                                     f"them differently (tied weights need one layout; replicate both or neither).")


def param_layouts_by_id(model: nn.Module, plan: RankPlan) -> dict[int, ParamLayout]:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name in plan.params:
            out[id(p)] = plan.params[name]
    for name, p in model.named_parameters(remove_duplicate=False):  # tied names share the layout
        if name not in plan.params and id(p) in out:
            plan.params[name] = out[id(p)]
    return out


def local_model(model: nn.Module, plan: RankPlan, materialize: bool = True) -> nn.Module:
    """A copy of ``model`` holding only this rank's shards, with local size attributes.

    Parameters are copied (the local model never aliases the full one); tied parameters stay tied.
    ``materialize=False`` makes meta-device parameters (enough to lower and print a program)."""
    layouts = param_layouts_by_id(model, plan)
    memo: dict[int, object] = {}
    for p in {id(q): q for q in model.parameters()}.values():
        layout = layouts.get(id(p))
        data = p.detach() if layout is None else layout.local(p.detach())
        data = data.clone() if materialize else torch.empty_like(data, device="meta")
        memo[id(p)] = nn.Parameter(data, requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().clone()
    local = copy.deepcopy(model, memo)
    for path, sh in plan.modules.items():
        mod = local.get_submodule(path)
        for name, value in sh.attrs.items():
            setattr(mod, name, value)
        for sub, (fin, fout) in sh.linear_sizes.items():
            _set_sizes(mod.get_submodule(sub) if sub else mod, fin, fout)
    return local


def _set_sizes(mod: nn.Module, fin: int, fout: int) -> None:
    if isinstance(mod, nn.Linear):
        mod.in_features, mod.out_features = fin, fout
    elif isinstance(mod, nn.Conv1d):
        mod.in_channels, mod.out_channels, mod.groups = fin, fout, fout
