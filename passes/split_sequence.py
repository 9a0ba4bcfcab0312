"""``split_sequence``: context parallelism.  The sequence is split over the cp ranks for every op.

Needs: a per-rank graph lowered for this rank's piece of the sequence (``mambac.lowering`` slices
every sequence input, dim 1 of each tensor input of two or more dims), ``gm.meta[MESH]`` with
``cp > 1`` and ``gm.meta[CP_LENGTH]`` (the whole sequence's length); runs after the tensor-parallel
passes, so it sees the tp-local sequence ops.
Guarantees:
- each sequence op (``causal_conv1d``, ``ssd``, ``selective_scan``, ``mamba3_siso``,
  ``mamba3_mimo``) is replaced by its context-parallel form (``mambac.runtime.context_parallel``):
  a halo exchange for the conv, state passing (one all-gather of fp32 summaries whose size does
  not depend on the length, an exclusive prefix combine, a pass from the incoming state) for the
  scans, forward and backward; an SSD whose final state nothing reads gets ``final=False``, so its
  form does not form it;
- per-token ops are left as they are (they need no communication);
- a cross-entropy loss (rewritten by ``propagate_sharding`` into a token sum over a token count)
  has both all-reduced over the cp ranks, so every rank returns the mean over the whole sequence;
- tensor outputs that carry the sequence are all-gathered over the cp ranks (``output='full'``)
  or left as this rank's piece (``output='sharded'``);
- anything else that mixes tokens is rejected with a ``MambacPassError`` naming the node: an op that
  reduces over the sequence, changes its length, or holds two sequence dims (attention-like), and
  known cross-token functions (cumsum, flip, an unfused conv, ...).
The sequence dims of every value are found by propagating shapes a second time at twice this
rank's length: a dim whose size changes holds the sequence.  Counts in ``ctx.stats['split_sequence']``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from mambac.capture import FAKE_MODE_KEY, repropagate
from mambac.errors import MambacPassError
from mambac.ir import CP_LENGTH, FUSION, MESH, PLACEMENT, VAL, source_of
from mambac.ops._common import info_for_target
from mambac.passes.context import PassContext
from mambac.passes.rewrite import insert_after, insert_before, output_of, replace_input, replace_uses
from mambac.runtime import context_parallel as cpf
from mambac.runtime import parallel_ops as pops

NAME = "split_sequence"
OPS = torch.ops.mambac

# op name -> (context-parallel form, op arguments it takes, extra arguments it needs)
CP_FORMS = {
    "causal_conv1d": (cpf.cp_causal_conv1d, ("x", "weight", "bias", "activation"), ("full_len",)),
    "ssd": (cpf.cp_ssd, ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "chunk_size", "dt_softplus", "dt_min",
                         "dt_max"), ()),
    "selective_scan": (cpf.cp_selective_scan, ("u", "delta", "A", "B", "C", "D", "z", "delta_bias",
                                               "delta_softplus"), ()),
    "mamba3_siso": (cpf.cp_mamba3_siso, ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias", "D",
                                         "z", "chunk_size"), ()),
    "mamba3_mimo": (cpf.cp_mamba3_mimo, ("x", "B", "C", "dt", "adt", "trap", "angles", "B_bias", "C_bias",
                                         "mimo_x", "mimo_z", "mimo_o", "D", "z", "chunk_size"), ()),
}
INITIAL = ("initial_state", "initial_angle", "initial_ssm", "initial_k", "initial_v")
LOSS_PARTS = (pops.ce_sum, pops.vocab_parallel_ce_sum, pops.token_count)
CROSS_TOKEN = {torch.cumsum: "cumsum", torch.cumprod: "cumprod", torch.flip: "flip", torch.roll: "roll",
               F.conv1d: "conv1d", F.pad: "pad", F.scaled_dot_product_attention: "attention",
               torch.fft.fft: "fft", torch.fft.rfft: "rfft"}
CROSS_TOKEN_METHODS = {"cumsum", "cumprod", "flip", "roll"}
SHAPE_READS = (getattr, operator.getitem)


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [v for v in val if isinstance(v, torch.Tensor)]
    return []


def sequence_dims(gm: torch.fx.GraphModule) -> dict[str, list[tuple[int, ...]]]:
    """Node name -> per output tensor, the dims whose size follows the sequence length.

    Shapes are propagated again with every sequence input twice as long (fake tensors) and
    compared with the lowered shapes; the graph's own shapes are restored afterwards."""
    mode = gm.meta[FAKE_MODE_KEY]
    saved = {n: (n.meta.get(VAL), n.meta.get("tensor_meta")) for n in gm.graph.nodes}
    longer = []
    for p in (n for n in gm.graph.nodes if n.op == "placeholder"):
        v = p.meta.get(VAL)
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            shape = list(v.shape)
            shape[1] *= 2
            with mode:
                v = torch.empty(shape, dtype=v.dtype, device=v.device)
        longer.append(v)
    try:
        repropagate(gm, mode, longer)
        probed = {n.name: [tuple(t.shape) for t in _tensors(n.meta.get(VAL))] for n in gm.graph.nodes}
    finally:
        for n, (val, tm) in saved.items():
            n.meta[VAL] = val
            if tm is not None:
                n.meta["tensor_meta"] = tm
    out = {}
    for n in gm.graph.nodes:
        mine = [tuple(t.shape) for t in _tensors(saved[n][0])]
        other = probed.get(n.name, [])
        out[n.name] = [tuple(d for d, (a, b) in enumerate(zip(s, o)) if a != b) if len(s) == len(o) else ()
                       for s, o in zip(mine, other)]
    return out


class _Splitter:
    def __init__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> None:
        self.gm, self.mesh = gm, gm.meta[MESH]
        self.full_len = gm.meta[CP_LENGTH]
        self.group = (self.mesh.cp_rank, self.mesh.cp, self.mesh.cp_group)
        self.stats = ctx.stats_for(NAME)
        self.seq = sequence_dims(gm)

    def has_seq(self, node) -> bool:
        return isinstance(node, torch.fx.Node) and any(self.seq.get(node.name, ()))

    # -- checks --------------------------------------------------------------------------------
    def check(self, node: torch.fx.Node) -> None:
        if node.op in ("placeholder", "output", "get_attr"):
            return
        if node.op == "call_function" and (node.target in SHAPE_READS or info_for_target(node.target) is not None
                                           or node.target in LOSS_PARTS):
            return
        ins = [i for i in node.all_input_nodes if self.has_seq(i)]
        if not ins:
            return
        where = f"node '{node.name}' ({_describe(node)}, from {source_of(node).module_path or 'the model'})"
        what = _cross_token(node)
        if what:
            raise MambacPassError(f"context parallelism: {where} applies {what} along values that hold the "
                                  "sequence; each cp rank holds only its piece, so it would see part of it. Use "
                                  "mambac's sequence ops (or run this model with cp=1).")
        dims = self.seq.get(node.name, [])
        if not any(dims) and _tensors(node.meta.get(VAL)):
            raise MambacPassError(f"context parallelism: {where} reduces over the sequence (input "
                                  f"'{ins[0].name}'), so each cp rank would return a result for its piece only. "
                                  "Return per-token values (e.g. logits), or use F.cross_entropy(reduction='mean'), "
                                  "which mambac reduces over the cp ranks.")
        if any(len(d) > 1 for d in dims):
            raise MambacPassError(f"context parallelism: {where} produces a value with two sequence dims "
                                  "(tokens mixed with tokens, as attention does); only mambac's sequence ops "
                                  "may mix tokens under cp.")
        if not self.mesh.sequence_parallel:
            for t, d in zip(_tensors(node.meta.get(VAL)), dims):
                for dim in d:
                    if t.shape[dim] % _local_len(self.gm):
                        raise MambacPassError(
                            f"context parallelism: {where} changes the sequence length (dim {dim} has "
                            f"{t.shape[dim]} entries for {_local_len(self.gm)} tokens), e.g. by slicing or "
                            "padding along the sequence; shift labels outside the model instead.")

    # -- rewrites ------------------------------------------------------------------------------
    def swap(self, node: torch.fx.Node) -> None:
        info = info_for_target(node.target)
        form, names, extra = CP_FORMS[info.name]
        args = dict(zip(info.arg_names, node.args))
        args.update(node.kwargs)
        for name in INITIAL:
            if args.get(name) is not None:
                raise MambacPassError(f"context parallelism: {info.name} node '{node.name}' is given an initial "
                                      f"{name.split('_', 1)[1]}; under cp the incoming state of each piece comes "
                                      "from the earlier ranks. Drop it, or run with cp=1.")
        call = [args[n] for n in names] + [{"full_len": self.full_len}[e] for e in extra] + list(self.group)
        # an SSD whose final state nothing reads: its cp form does not form it (a read and a write
        # of the state saved on every rank but the first, a copy on the first)
        kwargs = {"final": False} if info.name == "ssd" and not _reads_output(node, 1) else None
        new = insert_before(node, "call_function", form, tuple(call), kwargs, created_by=NAME)
        for key in (PLACEMENT, FUSION):  # same placement, same fused prologue/epilogue
            if key in node.meta:
                new.meta[key] = node.meta[key]
        self.stats.add(info.name)
        replace_uses(node, new)

    def reduce_loss_part(self, node: torch.fx.Node) -> None:
        red = insert_after(node, "call_function", OPS.all_reduce.default, (node, *self.group), created_by=NAME)
        if PLACEMENT in node.meta:
            red.meta[PLACEMENT] = node.meta[PLACEMENT]
        for user in list(node.users):
            if user is not red:
                replace_input(user, node, red)
        self.stats.add("loss_all_reduce")

    def gather_outputs(self, out: torch.fx.Node) -> None:
        if self.mesh.output == "sharded":
            return
        replaced = {}
        for value in out.all_input_nodes:
            dims = self.seq.get(value.name, [])
            if not (isinstance(value.meta.get(VAL), torch.Tensor) and dims and dims[0]):
                continue
            dim = dims[0][0]
            g = insert_before(out, "call_function", OPS.all_gather.default,
                              (value, dim, self.full_len, *self.group), created_by=NAME)
            if PLACEMENT in value.meta:
                g.meta[PLACEMENT] = value.meta[PLACEMENT]
            replaced[value] = g
            self.stats.add("output_all_gather")
        for old, new in replaced.items():
            replace_input(out, old, new)


def _reads_output(node: torch.fx.Node, index: int) -> bool:
    """Whether a user of ``node`` may read its output ``index``: a ``getitem`` of that index that
    something uses, or any user that is not a ``getitem``."""
    def reads(user: torch.fx.Node) -> bool:
        if output_of(user, index) is node:
            return bool(user.users)
        return not (user.op == "call_function" and user.target is operator.getitem)
    return any(reads(u) for u in node.users)


def _local_len(gm: torch.fx.GraphModule) -> int:
    for p in gm.graph.nodes:
        v = p.meta.get(VAL) if p.op == "placeholder" else None
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            return int(v.shape[1])
    raise MambacPassError("context parallelism needs a tensor input of at least 2 dims (batch, sequence, ...).")


def _cross_token(node: torch.fx.Node) -> str:
    if node.op == "call_function" and node.target in CROSS_TOKEN:
        return CROSS_TOKEN[node.target]
    if node.op == "call_method" and node.target in CROSS_TOKEN_METHODS:
        return str(node.target)
    if node.op == "call_module":
        mod = node.graph.owning_module.get_submodule(str(node.target))
        if isinstance(mod, (torch.nn.Conv1d, torch.nn.MultiheadAttention, torch.nn.RNNBase)):
            return type(mod).__name__
    return ""


def _describe(node: torch.fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def split_sequence(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    if gm.meta[MESH].cp == 1:
        return gm
    sp = _Splitter(gm, ctx)
    _local_len(gm)
    for node in list(gm.graph.nodes):
        sp.check(node)
    for node in list(gm.graph.nodes):
        info = info_for_target(node.target) if node.op == "call_function" else None
        if info is not None and info.name in CP_FORMS:
            sp.swap(node)
        elif node.op == "call_function" and node.target in LOSS_PARTS:
            sp.reduce_loss_part(node)
    sp.gather_outputs(next(n for n in gm.graph.nodes if n.op == "output"))
    gm.graph.lint()
    gm.recompile()
    return gm
