"""Synthetic tasks from the Mamba paper, generated on the fly: selective copying and induction heads.

Both return ``(input_ids, labels)`` with labels ``-100`` where no prediction is scored, so the mean
cross-entropy of a causal LM (``model(input_ids, labels)``) trains exactly the scored positions.

Vocabulary layout (``TASK_VOCAB`` ids): 0 blank/noise, 1..n_data data tokens, then a copy marker
and an induction marker.
"""
from __future__ import annotations

import torch

N_DATA = 8
BLANK, COPY, INDUCT = 0, N_DATA + 1, N_DATA + 2
TASK_VOCAB = N_DATA + 3


def selective_copying(batch: int, n_tokens: int = 3, span: int = 12, generator: torch.Generator | None = None):
    """``span`` positions holding ``n_tokens`` data tokens at random places among blanks, a COPY
    marker, then the data tokens in order; the model must reproduce them after the marker."""
    seqlen = span + 1 + n_tokens
    ids = torch.full((batch, seqlen), BLANK, dtype=torch.long)
    data = torch.randint(1, N_DATA + 1, (batch, n_tokens), generator=generator)
    pos = torch.rand(batch, span, generator=generator).argsort(dim=1)[:, :n_tokens].sort(dim=1).values
    ids.scatter_(1, pos, data)
    ids[:, span] = COPY
    ids[:, span + 1:] = data
    labels = torch.full_like(ids, -100)
    labels[:, span:span + n_tokens] = data  # position t predicts token t+1
    return ids, labels


def induction_heads(batch: int, seqlen: int = 16, generator: torch.Generator | None = None):
    """Random data tokens; an INDUCT marker followed by a key somewhere early; the marker again at
    the end, where the model must predict the key (copy what followed the marker last time)."""
    ids = torch.randint(1, N_DATA + 1, (batch, seqlen), generator=generator)
    where = torch.randint(0, seqlen - 4, (batch,), generator=generator)
    rows = torch.arange(batch)
    ids[ids == INDUCT] = 1
    ids[rows, where] = INDUCT
    key = ids[rows, where + 1]
    ids[:, -1] = INDUCT
    labels = torch.full((batch, seqlen), -100, dtype=torch.long)
    labels[:, -1] = key
    # the key is the next token after the final marker: append it so targets are inputs shifted by one
    return torch.cat([ids, key[:, None]], 1), torch.cat([labels, torch.full((batch, 1), -100)], 1)


def mixed_batch(batch: int, generator: torch.Generator | None = None):
    """Half selective copying, half induction heads, padded to one length with blanks."""
    a_ids, a_lab = selective_copying(batch // 2, generator=generator)
    b_ids, b_lab = induction_heads(batch - batch // 2, generator=generator)
    length = max(a_ids.shape[1], b_ids.shape[1])
    pad = lambda t, v: torch.nn.functional.pad(t, (0, length - t.shape[1]), value=v)  # noqa: E731
    ids = torch.cat([pad(a_ids, BLANK), pad(b_ids, BLANK)])
    labels = torch.cat([pad(a_lab, -100), pad(b_lab, -100)])
    return ids, labels


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Fraction of scored positions whose arg-max prediction is right."""
    mask = labels != -100
    return (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
