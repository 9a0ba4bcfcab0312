"""Reference causal LM: embedding, residual blocks with add+RMSNorm, optional gated MLP, tied head.

Module and parameter names follow mamba_ssm's ``MambaLMHeadModel`` (``backbone.embedding``,
``backbone.layers.{i}.mixer``/``.norm``/``.mlp``/``.norm2``, ``backbone.norm_f``, ``lm_head``) so a
mamba_ssm checkpoint loads with ``load_state_dict`` as it is.
"""
from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from mambac import ops
from mambac.errors import MambacInputError
from mambac.models.config import MambaConfig
from mambac.models.layers import GatedMLP, RMSNorm


def make_mixer(config: MambaConfig, layer_idx: int, device=None, dtype=None) -> nn.Module:
    kw = dict(config.mixer_kwargs(), layer_idx=layer_idx, device=device, dtype=dtype)
    if config.layer == "Mamba1":
        from mambac.models.mamba1 import Mamba
        return Mamba(config.d_model, **kw)
    if config.layer == "Mamba2":
        from mambac.models.mamba2 import Mamba2
        return Mamba2(config.d_model, **kw)
    from mambac.models.mamba3 import Mamba3
    return Mamba3(config.d_model, **kw)


class Block(nn.Module):
    """Pre-norm residual block: (hidden, residual) → mixer(norm(hidden + residual)), new residual."""

    def __init__(self, config: MambaConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(config.d_model, eps=config.norm_epsilon, **kw)
        self.mixer = make_mixer(config, layer_idx, **kw)
        if config.d_intermediate > 0:
            self.norm2 = RMSNorm(config.d_model, eps=config.norm_epsilon, **kw)
            self.mlp = GatedMLP(config.d_model, hidden_features=config.d_intermediate, out_features=config.d_model, **kw)
        else:
            self.mlp = None

    def _enter(self, hidden, residual, norm: RMSNorm):
        # Written unfused (add, then norm); fuse_ssm folds the add into add_rmsnorm.
        total = hidden if residual is None else hidden + residual
        return ops.add_rmsnorm(total, None, norm.weight, norm.eps, self.residual_in_fp32)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        hidden_states, residual = self._enter(hidden_states, residual, self.norm)
        hidden_states = self.mixer(hidden_states)
        if self.mlp is not None:
            hidden_states, residual = self._enter(hidden_states, residual, self.norm2)
            hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class MixerModel(nn.Module):
    def __init__(self, config: MambaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        kw = dict(device=device, dtype=dtype)
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model, **kw)
        self.layers = nn.ModuleList([Block(config, i, **kw) for i in range(config.n_layer)])
        self.norm_f = RMSNorm(config.d_model, eps=config.norm_epsilon, **kw)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embedding(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual)
        total = hidden_states + residual
        return ops.add_rmsnorm(total, None, self.norm_f.weight, self.norm_f.eps, self.config.residual_in_fp32)[0]


class MambaLMHeadModel(nn.Module):
    """The reference causal LM.  ``forward(input_ids)`` gives logits (batch, seqlen, padded vocab);
    ``forward(input_ids, labels)`` gives the mean next-token cross-entropy (labels already shifted,
    ``-100`` ignored)."""

    def __init__(self, config: MambaConfig, initializer_range: float = 0.02, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.backbone = MixerModel(config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.d_model, config.padded_vocab_size, bias=False, device=device, dtype=dtype)
        self._init_weights(initializer_range)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight

    def _init_weights(self, std: float) -> None:
        n_residuals = 2 if self.config.d_intermediate > 0 else 1
        with torch.no_grad():
            nn.init.normal_(self.backbone.embedding.weight, std=std)
            for name, mod in self.named_modules():
                if isinstance(mod, nn.Linear) and mod.bias is not None and not name.endswith("dt_proj"):
                    nn.init.zeros_(mod.bias)
                if name.endswith("out_proj") or name.endswith("fc2"):
                    nn.init.kaiming_uniform_(mod.weight, a=math.sqrt(5))
                    mod.weight /= math.sqrt(n_residuals * self.config.n_layer)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.backbone(input_ids)
        logits = self.lm_head(hidden)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)

    def save_pretrained(self, save_directory) -> None:
        """Write ``config.json`` and ``pytorch_model.bin`` as mamba_ssm's ``save_pretrained`` does
        (readable by mamba_ssm, ``mambac.from_pretrained`` and ``from_pretrained`` here;
        ``mambac/models/lm_io.py``)."""
        from mambac.models.lm_io import save_pretrained
        save_pretrained(self, save_directory)

    @classmethod
    def from_pretrained(cls, pretrained_model_name, device=None, dtype=None, **kwargs) -> "MambaLMHeadModel":
        """mamba_ssm's ``MambaLMHeadModel.from_pretrained`` for a local directory (mamba_ssm's or a
        Hugging Face Mamba/Mamba2 layout); nothing is downloaded."""
        if kwargs:
            raise MambacInputError(f"from_pretrained takes (path, device=None, dtype=None); got {sorted(kwargs)}.")
        from mambac.models.lm_io import from_pretrained
        return from_pretrained(cls, pretrained_model_name, device=device, dtype=dtype)

    def example_inputs(self, batch: int = 2, seqlen: int = 16, device=None) -> tuple[torch.Tensor]:
        """Random token ids of the given size (used to capture shapes when none are given), on the
        model's device unless ``device`` says otherwise."""
        device = self.lm_head.weight.device if device is None else device
        return (torch.randint(0, self.config.vocab_size, (batch, seqlen), device=device),)


IGNORE_INDEX = -100  # labels equal to this add nothing to the loss (the models' cross-entropy)


def check_token_batch(input_ids, labels=None, vocab_size: int | None = None, empty_length_ok: bool = False) -> None:
    """Clear ``MambacInputError`` for token ids (and labels) a causal LM cannot take, before any
    kernel or collective runs: tensors of integer ids shaped (batch, seqlen), labels of the same
    shape, at least one token (``empty_length_ok``: a rank's piece of the sequence may be empty),
    ids inside ``[0, vocab_size)`` and labels there too or ``IGNORE_INDEX``.

    The ranges cost one host read per call: on CUDA that is the call's only synchronisation."""
    for what, t in (("input_ids", input_ids), ("labels", labels)):
        if t is None and what == "labels":
            continue
        if not isinstance(t, torch.Tensor):
            raise MambacInputError(f"{what} must be a tensor, got {type(t).__name__}.")
        if t.dtype not in (torch.int64, torch.int32):
            raise MambacInputError(f"{what} must hold integer token ids (int64 or int32), got {t.dtype}.")
        if t.dim() != 2:
            hint = " (one sequence: ids[None])" if t.dim() == 1 else ""
            raise MambacInputError(f"{what} must be (batch, seqlen) token ids, got shape {tuple(t.shape)}{hint}.")
    shape = tuple(input_ids.shape)
    if labels is not None and tuple(labels.shape) != shape:
        raise MambacInputError(f"input_ids {shape} and labels {tuple(labels.shape)} differ in shape; they must match.")
    if labels is not None and labels.numel() and labels.data_ptr() == input_ids.data_ptr() \
            and labels.stride() == input_ids.stride():
        warnings.warn("labels are input_ids themselves: the LM takes labels already shifted (label t is token t + 1, "
                      "mamba_ssm's convention), so this trains each position to copy its own token. For Hugging "
                      "Face's labels=ids pass (ids[:, :-1], ids[:, 1:]).", UserWarning, stacklevel=3)
    if shape[0] == 0 or (shape[1] == 0 and not empty_length_ok):
        raise MambacInputError(f"input_ids of shape {shape} hold no tokens; pass at least one sequence of at least "
                               "one token.")
    if vocab_size is None or not input_ids.numel():
        return
    ranges = [*torch.aminmax(input_ids)]
    if labels is not None:
        ranges += [*torch.aminmax(torch.where(labels != IGNORE_INDEX, labels, 0))]
    lo, hi, *lab = torch.stack([r.to(torch.int64) for r in ranges]).tolist()
    if lo < 0 or hi >= vocab_size:
        raise MambacInputError(f"token ids must lie in [0, {vocab_size}); this batch has {lo}..{hi}, outside "
                               f"[0, {vocab_size}): check that the tokenizer matches the model's vocabulary.")
    if lab and (lab[0] < 0 or lab[1] >= vocab_size):
        raise MambacInputError(f"labels must lie in [0, {vocab_size}) or be {IGNORE_INDEX} (ignored); this batch has "
                               f"{lab[0]}..{lab[1]}.")
