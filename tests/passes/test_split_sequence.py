"""split_sequence, lowered without a process group: what it puts in each rank's program, that its
communication does not grow with the sequence, and the clear errors for models it cannot split."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mambac.errors import MambacInputError, MambacPassError
from mambac.explain import communication_rows
from mambac.lowering import lower_all_ranks
from mambac.models.mamba2 import Mamba2
from mambac.runtime import context_parallel as cpf
from tests.models.tiny import tiny_lm

M2 = dict(layer="Mamba2", d_state=8, headdim=8, chunk_size=4)


def _ids(b=2, L=12):
    return torch.randint(0, 37, (b, L), generator=torch.Generator().manual_seed(0))


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_every_rank_gets_cp_forms_of_its_sequence_ops():
    model = tiny_lm("mamba2", n_layer=2, ssm_cfg=M2)
    programs = lower_all_ranks(model, (_ids(), _ids()), 4, tp=2, cp=2)
    for rank, prog in enumerate(programs):
        targets = _targets(prog.gm)
        assert targets.count(cpf.cp_ssd) == 2 and targets.count(cpf.cp_causal_conv1d) == 2, rank
        counts = prog.ctx.stats["split_sequence"].counts
        assert counts == {"ssd": 2, "causal_conv1d": 2, "loss_all_reduce": 2}, counts
        gm_text = prog.ctx.history[-1][1]
        assert f"cp_ssd" in gm_text and f", {rank // 2}, 2, 'cp')" in gm_text  # this rank's cp coordinate


class _ReturnsFinal(nn.Module):
    """A bare SSD that returns its output and, if asked, its final state."""

    def __init__(self, keep_final):
        super().__init__()
        self.A = nn.Parameter(-torch.rand(2) - 0.5)
        self.keep_final = keep_final

    def forward(self, x, dt, B, C):
        y, final = torch.ops.mambac.ssd(x, dt, self.A, B, C, None, None, None, None, 4, True, 0.0, float("inf"))
        return (y, final) if self.keep_final else y


@pytest.mark.parametrize("keep_final", [False, True])
def test_ssd_forms_skip_a_final_state_nothing_reads(keep_final):
    lm = lower_all_ranks(tiny_lm("mamba2", n_layer=2, ssm_cfg=M2), (_ids(), _ids()), 2, cp=2)[1].gm
    assert [n.kwargs for n in lm.graph.nodes if n.target is cpf.cp_ssd] == [{"final": False}] * 2
    g = torch.Generator().manual_seed(0)
    ins = (torch.randn(1, 12, 2, 4, generator=g), torch.rand(1, 12, 2, generator=g),
           torch.randn(1, 12, 1, 4, generator=g), torch.randn(1, 12, 1, 4, generator=g))
    gm = lower_all_ranks(_ReturnsFinal(keep_final), ins, 2, cp=2, output="sharded")[1].gm
    (node,) = [n for n in gm.graph.nodes if n.target is cpf.cp_ssd]
    assert node.kwargs == ({} if keep_final else {"final": False})
    assert (node.meta["val"][1] is None) != keep_final


@pytest.mark.parametrize("family", ["mamba1", "mamba3"])
def test_other_families_use_their_cp_forms(family):
    cfg = dict(layer="Mamba1", d_state=8) if family == "mamba1" else dict(layer="Mamba3", d_state=8, headdim=8,
                                                                          chunk_size=4)
    model = tiny_lm(family if family != "mamba3" else "mamba2", n_layer=1, ssm_cfg=cfg)
    targets = _targets(lower_all_ranks(model, (_ids(),), 2, cp=2)[1].gm)
    want = cpf.cp_selective_scan if family == "mamba1" else cpf.cp_mamba3_siso
    assert want in targets


def _cp_bytes(L):
    model = tiny_lm("mamba2", n_layer=1, ssm_cfg=M2)
    rows = communication_rows(lower_all_ranks(model, (_ids(L=L),), 2, cp=2)[1].gm)
    return {(k, g): (f, b) for k, g, _, f, b in rows}


def test_cp_exchange_payload_does_not_grow_with_the_sequence():
    short, long = _cp_bytes(16), _cp_bytes(64)
    assert short[("cp_exchange", "cp")] == long[("cp_exchange", "cp")]
    assert short[("cp_exchange", "cp")][0] > 0
    # the gathered logits (the output) do grow: they are the output, not the scan's communication
    assert long[("all_gather", "cp")][0] == 4 * short[("all_gather", "cp")][0]


class _Mixer(nn.Module):
    def __init__(self, head):
        super().__init__()
        self.mixer = Mamba2(16, d_state=8, headdim=8, chunk_size=4)
        self.head = head

    def forward(self, x):
        return self.head(self.mixer(x))


def _lower_cp(head):
    x = torch.randn(2, 12, 16)
    return lower_all_ranks(_Mixer(head), (x,), 2, cp=2)


def test_plain_module_output_is_gathered():
    prog = _lower_cp(lambda y: y)[1]
    out = next(n for n in prog.gm.graph.nodes if n.op == "output")
    assert tuple(out.args[0].meta["val"].shape) == (2, 12, 16)


@pytest.mark.parametrize("head, words", [
    (lambda y: y.mean(), "reduces over the sequence"),
    (lambda y: y[:, :-1] * 2, "changes the sequence length"),
    (lambda y: torch.cumsum(y, 1), "cumsum"),
    (lambda y: torch.softmax(y @ y.transpose(1, 2), -1) @ y, "two sequence dims"),
])
def test_token_mixing_outside_the_sequence_ops_is_rejected(head, words):
    with pytest.raises(MambacPassError, match=words):
        _lower_cp(head)


def test_user_initial_state_is_rejected():
    from mambac import ops

    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.s0 = nn.Parameter(torch.randn(1, 2, 4, 4))

        def forward(self, x, dt, B, C):
            return ops.ssd(x, dt, -torch.ones(2), B, C, chunk_size=4, initial_state=self.s0)

    args = (torch.randn(1, 8, 2, 4), torch.rand(1, 8, 2), torch.randn(1, 8, 1, 4), torch.randn(1, 8, 1, 4))
    with pytest.raises(MambacPassError, match="initial state"):
        lower_all_ranks(WithState(), args, 2, cp=2)


def test_sequence_shorter_than_cp_is_a_clear_error():
    model = tiny_lm("mamba2", n_layer=1, ssm_cfg=M2)
    with pytest.raises(MambacInputError, match="at least 4 tokens"):
        lower_all_ranks(model, (_ids(L=3),), 4, cp=4)


def test_sequence_inputs_must_agree_in_length():
    model = tiny_lm("mamba2", n_layer=1, ssm_cfg=M2)
    with pytest.raises(MambacInputError, match="same length"):
        lower_all_ranks(model, (_ids(L=8), _ids(L=9)), 2, cp=2)


def test_remat_keeps_the_cp_exchanges_outside_recompute_regions():
    from mambac.passes.plan_remat import RematRegion
    model = tiny_lm("mamba2", n_layer=2, ssm_cfg=M2)
    gm = lower_all_ranks(model, (_ids(), _ids()), 2, cp=2, remat="full")[1].gm
    bodies = [m.body for m in gm.modules() if isinstance(m, RematRegion)]
    forms = set(cpf.CP_FORMS)
    assert bodies and not any(n.target in forms for b in bodies for n in b.graph.nodes)
    assert sum(t in forms for t in _targets(gm)) == 4   # 2 convs + 2 scans, each run once forward
