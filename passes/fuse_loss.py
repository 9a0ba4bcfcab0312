"""``fuse_loss``: fold an LM head and its cross-entropy into one chunked ``linear_cross_entropy``.

Needs: a captured graph with shapes (``meta['val']``), one rank (``world_size == 1``; the
distributed pipeline rewrites the loss for a vocab-parallel head instead and does not run this).
Guarantees: the program computes the same loss and gradients; the full (tokens, vocab) logits are
never materialised (``mambac.ops.linear_cross_entropy`` works a chunk of tokens at a time); every
match is counted in ``ctx.stats['fuse_loss']['linear_cross_entropy']``; the fused node records
``fused: linear_cross_entropy`` and the ``lm_head`` provenance; the absorbed nodes are left dead
for ``eliminate_dead_code``.

Pattern (every intermediate has exactly one user, so logits someone else reads are never fused)::

    logits = self.lm_head(h)                   # nn.Linear, bias=False (or F.linear(h, weight), as dynamo inlines it)
    x = logits[.float()][.flatten(0, 1) | .reshape(-1, V) | .view(-1, V) | .contiguous()]*   # (N, V)
    loss = F.cross_entropy(x, labels_flat, ignore_index=I)   # reduction='mean', no weight, no smoothing
  →
    loss = linear_cross_entropy(h.flatten(0, -2), self.lm_head.weight, labels_flat, I)
"""
from __future__ import annotations

import inspect

import torch
import torch.fx
import torch.nn.functional as F

from mambac.ir import FUSION, SOURCE, VAL, SourceInfo, fusion_of, source_of
from mambac.ops.linear_cross_entropy import linear_cross_entropy
from mambac.passes.context import PassContext
from mambac.passes.rewrite import apply_until_fixed, insert_after, insert_before, is_call, replace_uses, shape

NAME = "fuse_loss"
FUSION_NAME = "linear_cross_entropy"
CROSS_ENTROPY = (F.cross_entropy,)
RESHAPES = ("flatten", "reshape", "view", "contiguous")
CASTS = ("float", "to")
_CE_SIGNATURE = inspect.signature(F.cross_entropy)
_CE_DEFAULTS = dict(weight=None, size_average=None, reduce=None, reduction="mean", label_smoothing=0.0)


def _ce_args(node: torch.fx.Node) -> dict | None:
    """The bound arguments of an F.cross_entropy node, or None if it is not one we fuse."""
    if not is_call(node, CROSS_ENTROPY):
        return None
    try:
        bound = _CE_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    args = dict(bound.arguments)
    if any(args[k] != v for k, v in _CE_DEFAULTS.items()) or not isinstance(args["ignore_index"], int):
        return None
    return args


def _val(node):
    return node.meta.get(VAL) if isinstance(node, torch.fx.Node) else None


def _view_step(node: torch.fx.Node, vocab: int) -> bool:
    """Whether ``node`` keeps the logits' rows and values: a reshape keeping the last dim V, or a
    cast up to fp32/fp64 on the same device."""
    if node.op == "call_function" and node.target in (torch.flatten, torch.reshape):
        pass
    elif node.op != "call_method" or node.target not in RESHAPES + CASTS:
        return False
    out, src = _val(node), _val(node.args[0])
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)) or out.dim() < 1 or out.shape[-1] != vocab:
        return False
    if out.device != src.device or out.numel() != src.numel():
        return False
    if node.target in CASTS:
        return out.dtype in (torch.float32, torch.float64) and out.shape == src.shape
    return out.dtype == src.dtype


LINEARS = (F.linear, torch._C._nn.linear)


def _head_weight(gm: torch.fx.GraphModule, node) -> torch.fx.Node | str | None:
    """The weight of a bias-free LM head at ``node``: an ``nn.Linear`` call (the weight's attribute
    path), or a ``F.linear(h, weight)`` call on a weight node (as dynamo's graphs inline the
    module; the weight node itself).  None if ``node`` is neither."""
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op == "call_module":
        if len(node.args) != 1 or node.kwargs:
            return None
        mod = gm.get_submodule(str(node.target))
        return f"{node.target}.weight" if isinstance(mod, torch.nn.Linear) and mod.bias is None else None
    if is_call(node, LINEARS) and len(node.args) >= 2 and isinstance(node.args[1], torch.fx.Node):
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        w = _val(node.args[1])
        if bias is None and isinstance(w, torch.Tensor) and w.dim() == 2 and not set(node.kwargs) - {"bias"}:
            return node.args[1]
    return None


def _match(gm: torch.fx.GraphModule, ce: torch.fx.Node):
    """(head node, chain of absorbed nodes, labels, ignore_index) if ``ce`` is a fusable loss."""
    args = _ce_args(ce)
    if args is None:
        return None
    x, labels = args["input"], args["target"]
    xs, ls = shape(x), shape(labels)
    if xs is None or ls is None or len(xs) != 2 or ls != (xs[0],) or _val(labels).dtype != torch.int64:
        return None
    vocab, chain, node = xs[1], [], x
    while isinstance(node, torch.fx.Node) and _head_weight(gm, node) is None:
        if list(node.users) != [chain[-1] if chain else ce] or not _view_step(node, vocab):
            return None
        chain.append(node)
        node = node.args[0]
    if _head_weight(gm, node) is None or list(node.users) != [chain[-1] if chain else ce]:
        return None
    if shape(node) is None or shape(node)[-1] != vocab:
        return None
    return node, chain, labels, args["ignore_index"]


def _fuse(gm: torch.fx.GraphModule, ce: torch.fx.Node) -> bool:
    got = _match(gm, ce)
    if got is None:
        return False
    head, chain, labels, ignore_index = got
    hidden = head.args[0]
    by = NAME
    created = []
    if len(shape(hidden)) != 2:
        hidden = insert_before(ce, "call_method", "flatten", (hidden, 0, -2), created_by=by)
        created.append(hidden)
    weight = _head_weight(gm, head)
    if isinstance(weight, str):
        weight = insert_before(ce, "get_attr", weight, (), created_by=by)
        created.append(weight)
    fused = insert_before(ce, "call_function", linear_cross_entropy, (hidden, weight, labels, ignore_index),
                          created_by=by)
    src = source_of(head)
    for n in created + [fused]:   # provenance: the head's module
        n.meta[SOURCE] = SourceInfo(src.module_path, src.module_type, by)
    fused.meta[FUSION] = fusion_of(fused).plus(FUSION_NAME)
    out = fused
    if _val(fused).dtype != _val(ce).dtype:  # e.g. fp64 head with .float(): keep the loss's dtype
        out = insert_after(fused, "call_method", "to", (fused, _val(ce).dtype), created_by=by)
    replace_uses(ce, out)
    for n in chain + [head]:  # each had one user, now erased
        n.graph.erase_node(n)
    return True


def fuse_loss(gm: torch.fx.GraphModule, ctx: PassContext) -> torch.fx.GraphModule:
    """Fuse every LM-head + cross-entropy match (one rank only), counting them."""
    stats = ctx.stats_for(NAME)
    if ctx.world_size != 1:
        stats.add(FUSION_NAME, 0)
        return gm
    stats.add(FUSION_NAME, apply_until_fixed(gm.graph, lambda n: _fuse(gm, n)))
    gm.recompile()
    return gm
