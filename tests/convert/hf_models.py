"""Tiny random Hugging Face Mamba / Mamba-2 models covering the config quirks mambac honours."""
from __future__ import annotations

import torch

BASE = dict(vocab_size=37, num_hidden_layers=2, use_cache=False)
CASES = {
    # Mamba-1: tied head, defaults
    "mamba_lm": ("MambaForCausalLM", dict(hidden_size=16, state_size=4)),
    # Mamba-1: every bias flag flipped, explicit dt rank, untied head, bf16-style residual, odd eps, wide conv
    "mamba_lm_quirks": ("MambaForCausalLM", dict(hidden_size=16, state_size=4, use_bias=True, use_conv_bias=False,
                                                 time_step_rank=3, tie_word_embeddings=False, residual_in_fp32=False,
                                                 layer_norm_epsilon=1e-3, conv_kernel=3, expand=3)),
    "mamba_backbone": ("MambaModel", dict(hidden_size=16, state_size=4)),
    # Mamba-2: two groups of two heads, untied (HF's default)
    "mamba2_lm_groups": ("Mamba2ForCausalLM", dict(hidden_size=16, num_heads=4, head_dim=8, n_groups=2,
                                                   state_size=4, chunk_size=4)),
    # Mamba-2: three heads in three groups, dt limits, biases, large norm eps, tied head
    "mamba2_lm_oddheads": ("Mamba2ForCausalLM", dict(hidden_size=12, num_heads=3, head_dim=8, n_groups=3,
                                                     state_size=4, chunk_size=4, time_step_limit=(0.01, 0.5),
                                                     layer_norm_epsilon=1e-2, use_bias=True,
                                                     tie_word_embeddings=True)),
    # Mamba-2 backbone: five heads, one group, no conv bias, chunk not dividing the sequence
    "mamba2_backbone_oddheads": ("Mamba2Model", dict(hidden_size=10, num_heads=5, head_dim=4, n_groups=1,
                                                     state_size=6, chunk_size=3, use_conv_bias=False)),
}


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The HF model of case ``name`` in eval mode, with norm weights, D and biases perturbed so that
    epsilons, gating and skips all change the output."""
    import transformers

    cls_name, kw = CASES[name]
    family = "Mamba2" if cls_name.startswith("Mamba2") else "Mamba"
    config = getattr(transformers, f"{family}Config")(**BASE, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for name_, p in model.named_parameters():
            leaf = name_.rsplit(".", 2)
            if "norm" in name_ or leaf[-1] in ("D", "bias", "dt_bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_output(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of an HF LM, last hidden states of an HF backbone (no cache)."""
    out = model(ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def checkpoint_reference(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What a checkpoint saved from ``model`` must compute once loaded.

    That is HF's own output where HF's Mamba-2 gated norm normalises ``n_groups`` groups as mamba_ssm
    does (recent transformers).  Older releases (5.17 and before) normalise the whole width; a
    checkpoint still loads with mamba_ssm's grouping, so there the reference is the live
    conversion of ``model`` with that grouping restored."""
    from mambac.convert import convert
    from mambac.models import Mamba2

    hf_norms = [m.norm for m in model.modules() if type(m).__name__ == "Mamba2Mixer"]
    if all(hasattr(n, "group_size") for n in hf_norms):
        return hf_output(model, ids)
    converted = convert(model)
    for mixer in converted.modules():
        if isinstance(mixer, Mamba2):
            mixer.norm.group_size = mixer.d_ssm // mixer.ngroups
    return converted(ids)
