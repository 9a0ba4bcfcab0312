"""The trainer at dp > 1 and across layouts (gloo, real processes): tp=1 × dp=2 and tp=2 × dp=2
train like one eager process on the same global batches; a tp=4 checkpoint resumes at tp=2 × dp=2
and on one process with the same later losses, AdamW moments and RNG state."""
from __future__ import annotations

import pytest
import torch

from mambac.trainer import Trainer
from tests.models.tiny import tiny_lm
from tests.training.ranks import run_ranks
from tests.training.test_trainer import make_trainer, rel
from tests.training.worker import DP2_DATA, W4_DATA


def eager_trainer() -> Trainer:
    """The launched script's model and settings, on the plain (uncompiled) model."""
    torch.manual_seed(0)
    return Trainer(tiny_lm("mamba2", n_layer=1), lr=3e-3, max_grad_norm=0.5, accum=2)


@pytest.fixture(scope="module")
def eager() -> dict:
    out = {}
    for name, data in (("dp2", DP2_DATA), ("w4", W4_DATA)):
        t, run = eager_trainer(), {"loss": {}, "norm": {}}
        for s in (1, 2, 3):
            run["loss"][str(s)] = t.step(*data.batch_at(s))
            run["norm"][str(s)] = t.grad_norm
            if s == 2:
                run["moments"] = {n: {k: v.clone() for k, v in t.opt.state[p].items()} for n, p in t.params.items()}
        out[name] = run
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dp2")
    return tmp, run_ranks(2, "dp2", str(tmp), timeout=150)


@pytest.fixture(scope="module")
def w4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w4")
    return tmp, run_ranks(4, "w4", str(tmp), timeout=200)


def assert_trains_like(run: dict, ref: dict) -> None:
    for s, loss in ref["loss"].items():
        assert rel(run["loss"][s], loss) <= 1e-5, (s, run, ref)
        # the unsharded norm, each dp replica counted once (counted twice it would be sqrt(2) larger)
        assert rel(run["norm"][s], ref["norm"][s]) <= 1e-5, (s, run, ref)
    assert max(ref["norm"].values()) > 0.5  # so clipping (max_grad_norm=0.5) was active


def test_dp2_trains_like_one_eager_process(dp2, eager):
    _, ranks = dp2
    for r in ranks:
        assert_trains_like(r["run"], eager["dp2"])
        assert r["replicas_agree"]


def test_tp2_dp2_trains_like_one_eager_process(w4, eager):
    _, ranks = w4
    for r in ranks:
        assert_trains_like(r["tp2dp2"], eager["w4"])
        assert_trains_like({k: {s: v for s, v in r["tp4"][k].items() if s != "4"} for k in ("loss", "norm")},
                           eager["w4"])
        assert r["replicas_agree"]


def test_tp2_cp2_trains_like_one_eager_process_and_resumes_tp4(w4, eager):
    _, ranks = w4
    for r in ranks:
        assert_trains_like(r["tp2cp2"], eager["w4"])
        res, ref = r["cp_resumed"], r["tp4"]
        assert res["loaded"] == 2
        assert all(rel(res["loss"][s], ref["loss"][s]) <= 1e-6 for s in ("3", "4")), (res, ref)


def test_dp2_resumes_at_dp2_with_each_ranks_rng(dp2):
    _, ranks = dp2
    for r in ranks:
        res = r["resumed"]
        assert res["loaded"] == 2 and res["rng"] == "cpu"
        assert res["draws"] == r["run"]["draws"]  # this rank's own generator, not rank 0's
        assert rel(res["loss"]["3"], r["run"]["loss"]["3"]) <= 1e-6
    assert ranks[0]["run"]["draws"] != ranks[1]["run"]["draws"]


def test_tp4_checkpoint_resumes_at_tp2_dp2(w4):
    _, ranks = w4
    for r in ranks:
        res, ref = r["resumed"], r["tp4"]
        assert res["loaded"] == 2 and res["rng"] == "cpu"
        assert res["draws"] == ref["draws"]
        assert all(rel(res["loss"][s], ref["loss"][s]) <= 1e-6 for s in ("3", "4")), (res, ref)


@pytest.mark.parametrize("scenario, sub, last", [("w4", "tp4", 4), ("dp2", "run", 3)])
def test_a_checkpoint_resumes_on_one_process(request, eager, scenario, sub, last):
    tmp, ranks = request.getfixturevalue(scenario)
    data = W4_DATA if scenario == "w4" else DP2_DATA
    trainer = make_trainer()
    torch.manual_seed(12345)
    assert trainer.load(str(tmp / ("tp4" if scenario == "w4" else "dp2"))) == 2
    assert trainer.rng_restored == "cpu of rank 0"  # another world size: rank 0's generator
    assert torch.rand(3).tolist() == ranks[0][sub]["draws"]
    # the AdamW moments came back unsharded (within fp32 summation order of the eager run)
    for name, p in trainer.params.items():
        for k, ref in eager[scenario]["moments"][name].items():
            got = trainer.opt.state[p][k]
            assert float((got - ref).abs().max()) <= 1e-4 * max(float(ref.abs().max()), 1e-12), (name, k)
    for s in range(3, last + 1):
        loss = trainer.step(*data.batch_at(s))
        assert rel(loss, ranks[0][sub]["loss"][str(s)]) <= 1e-6, s
