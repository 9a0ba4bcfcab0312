import torch

from mambac.tasks import BLANK, COPY, INDUCT, N_DATA, accuracy, induction_heads, mixed_batch, selective_copying


def test_selective_copying_layout():
    g = torch.Generator().manual_seed(0)
    ids, labels = selective_copying(16, n_tokens=3, span=10, generator=g)
    assert ids.shape == (16, 14) and (ids[:, 10] == COPY).all()
    for row, lab in zip(ids, labels):
        data = row[:10][row[:10] != BLANK]
        assert len(data) == 3 and ((data >= 1) & (data <= N_DATA)).all()
        assert torch.equal(row[11:], data)  # copied in order after the marker
        assert torch.equal(lab[10:13], data) and (lab[:10] == -100).all() and lab[13] == -100


def test_induction_heads_layout():
    ids, labels = induction_heads(32, seqlen=12, generator=torch.Generator().manual_seed(1))
    for row, lab in zip(ids, labels):
        marks = (row[:-1] == INDUCT).nonzero().flatten()
        assert len(marks) == 2 and marks[1] == 11
        assert row[-1] == row[marks[0] + 1]  # the answer is what followed the first marker
        assert lab[11] == row[-1] and (lab != -100).sum() == 1


def test_mixed_batch_and_accuracy():
    ids, labels = mixed_batch(10, generator=torch.Generator().manual_seed(2))
    assert ids.shape[0] == 10 and labels.shape == ids.shape
    perfect = torch.nn.functional.one_hot(labels.clamp_min(0), 16).float()
    assert accuracy(perfect, labels) == 1.0
