"""``mambac.comm``: per-layer collective payloads as formulas of batch and sequence length."""
import sympy

from mambac.comm import BATCH, SEQLEN, layer_comm, total_bytes
from tests.models.tiny import tiny_lm


def mixer(name: str, **over):
    return tiny_lm(name, n_layer=1, **over).backbone.layers[0].mixer


def test_context_parallel_payload_does_not_grow_with_sequence_length():
    for name in ("mamba1", "mamba2", "mamba3_siso", "mamba3_mimo_outnorm"):
        total = total_bytes(layer_comm(mixer(name), cp=4), axis="cp")
        assert SEQLEN not in total.free_symbols and BATCH in total.free_symbols, (name, total)


def test_mamba2_cp_payload_counts_halo_and_summaries():
    m = mixer("mamba2")  # d_inner 64, 8 heads of 8, d_state 8, ngroups 1, d_conv 4
    got = {c.what: c.bytes for c in layer_comm(m, cp=2)}
    conv_channels = 64 + 2 * 8
    assert got["conv halo"] == 2 * BATCH * conv_channels * 3 * 4
    assert got["scan summaries"] == 2 * BATCH * (8 * 8 * 8 + 8) * 4


def test_mamba3_summaries_carry_angle_ssm_key_value():
    m = mixer("mamba3_mimo_outnorm")  # d_model 24: 6 heads of 8, rank 2, d_state 8
    h, p, n, r, s = m.nheads, m.headdim, m.d_state, m.mimo_rank, m.num_rope_angles
    got = {c.what: c.bytes for c in layer_comm(m, cp=3)}
    assert got["scan summaries"] == 3 * BATCH * (h * s + h * p * n + r * h * n + h * p + 2 * h) * 4
    assert "conv halo" not in got


def test_tensor_parallel_grows_with_tokens_and_matches_lowered_counts():
    m = mixer("mamba2")  # ngroups=1 at tp=2: B/C replicated and the norm group straddles
    forward = [c for c in layer_comm(m, tp=2) if c.direction == "forward"]
    assert sorted(c.kind for c in forward) == ["all_reduce", "all_reduce"]   # as test_tensor_parallel counts
    assert total_bytes(forward) == BATCH * SEQLEN * (32 * 4 + 1 * 4)
    sp = layer_comm(m, tp=2, sequence_parallel=True)
    assert {c.kind for c in sp if c.what.startswith(("in_proj", "out_proj"))} == {"all_gather", "reduce_scatter"}


def test_mamba1_tp_includes_x_proj_and_tp_cp_shrinks_the_summary():
    m = mixer("mamba1")
    assert any(c.what.startswith("x_proj") for c in layer_comm(m, tp=2))
    alone = total_bytes(layer_comm(m, cp=2), axis="cp")
    with_tp = total_bytes(layer_comm(m, tp=2, cp=2), axis="cp")
    assert sympy.simplify(alone - 2 * with_tp) == 0
