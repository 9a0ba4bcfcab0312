"""Tensor descriptors of the descriptor-loading kernels (``codegen.tma``): which views are described
as they are and which are copied first, the direct-launch key of a descriptor, and the tile
config's ``tma`` field.  No kernel runs here (the interpreter tests in test_ssd_interp.py run them)."""
from __future__ import annotations

import pytest
import torch

from mambac.codegen import tma
from mambac.codegen.direct_launch import spec_key
from mambac.codegen.kernel_ir import TileConfig

def test_split_view_is_described_in_place():
    """x of a Mamba-2 conv output (a column slice of (batch, seqlen, columns)) is read where it lies:
    rows of batch*seqlen, one row stride apart."""
    buf = torch.zeros(2, 40, 4 * 16 + 2 * 32, dtype=torch.bfloat16)
    x = buf[..., :64].view(2, 40, 4, 16)
    d = tma.rows(x, 2, (16, 16))
    assert d.base.data_ptr() == x.data_ptr()
    assert list(d.shape) == [80, 64] and list(d.strides) == [128, 1] and list(d.block_shape) == [16, 16]


@pytest.mark.parametrize("make", [
    lambda: torch.zeros(2, 40, 64 + 3, dtype=torch.bfloat16)[..., :64],        # row stride of 134 bytes
    lambda: torch.zeros(2, 48, 64, dtype=torch.float32)[:, :40],                # batches 48 rows apart
    lambda: torch.zeros(2, 40, 64, dtype=torch.float32).transpose(0, 1),        # rows not in order
    lambda: torch.zeros(2 * 40 * 64 + 1, dtype=torch.float32)[1:].view(2, 40, 64),  # base off 16 bytes
], ids=["odd-row-stride", "gapped-batches", "transposed", "unaligned-base"])
def test_views_tma_cannot_address_are_copied(make):
    t = make()
    d = tma.rows(t, 2, (8, 64))
    assert d.base.data_ptr() != t.data_ptr() and d.base.is_contiguous()
    assert torch.equal(d.base.view(80, 64), t.reshape(80, 64))
    assert list(d.shape) == [80, 64] and list(d.strides) == [64, 1]


def test_direct_launch_key_follows_descriptor_layout():
    a = torch.zeros(4, 64, dtype=torch.float32)
    base = spec_key([a, tma.rows(a, 1, (16, 64)), 3])
    assert base is not None
    assert spec_key([a, tma.rows(a, 1, (32, 64)), 3]) != base              # another block
    assert spec_key([a, tma.rows(torch.zeros(8, 64), 1, (16, 64)), 3]) != base  # another size
    assert spec_key([a, tma.rows(torch.zeros(4, 64), 1, (16, 64)), 3]) == base


def test_tile_config_tma_field_round_trips():
    plain = TileConfig(block_m=64, block_k=32)
    assert "tma" not in plain.to_json()      # choices stored before the field keep their keys
    described = TileConfig(block_m=64, block_k=32, tma=True)
    assert TileConfig.from_json(described.to_json()) == described
    assert TileConfig.from_json(plain.to_json()) == plain


def test_rows_tma_cannot_load_are_refused():
    with pytest.raises(ValueError, match="not a multiple of 16 bytes"):
        tma.rows(torch.zeros(4, 6, dtype=torch.bfloat16), 1, (4, 8))


def test_knob_turns_descriptor_forms_off(monkeypatch):
    """``MAMBAC_TMA=0`` (here through ``knobs.override``) takes the descriptor forms out even where
    they could run (the interpreter)."""
    from mambac import knobs
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tma.available()
    with knobs.override(tma=False):
        assert not tma.available()
    assert tma.available()
