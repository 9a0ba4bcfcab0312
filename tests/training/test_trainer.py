"""The trainer loses nothing: resume (same layout, tp=2 -> one process), a checkpoint write killed
half way, a rank killed under ``mambac run --max-restarts``, and bad batches / non-finite steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mambac
from mambac.errors import MambacInputError, MambacRuntimeError
from mambac.runtime.launcher import launch
from mambac.trainer import SyntheticTokens, Trainer, latest_checkpoint
from tests.models.tiny import tiny_lm
from tests.training.scripts.train import fingerprint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "train.py"
DATA = SyntheticTokens(vocab=37, batch=4, seqlen=8)
STEPS = 5


def make_trainer() -> Trainer:
    """The same model and settings as the launched script, on one process."""
    from tests.training.scripts.train import make_trainer as build
    return build(1, 1)


def run_steps(trainer: Trainer, last: int) -> dict[int, float]:
    out = {}
    while trainer.step_count < last:
        step = trainer.step_count + 1
        out[step] = trainer.step(*DATA.batch_at(step))
    return out


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """One process, STEPS steps, a checkpoint after each."""
    root = tmp_path_factory.mktemp("single")
    trainer, losses = make_trainer(), {}
    while trainer.step_count < STEPS:
        losses.update(run_steps(trainer, trainer.step_count + 1))
        trainer.save(str(root))
    return root, losses


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> tuple[int, Path, Path]:
    """tp=2 under torchrun with one restart; rank 1 SIGKILLs itself at step 4 of the first attempt."""
    tmp = tmp_path_factory.mktemp("restart")
    root, log = tmp / "ck", tmp / "log"
    rc = launch(2, str(SCRIPT), [str(root), str(log), "--steps", str(STEPS), "--tp", "2", "--kill-rank", "1",
                                 "--kill-step", "4"], timeout=170, max_restarts=1)
    return rc, root, log


def test_same_layout_resume_continues_the_same_losses(single):
    root, losses = single
    trainer = make_trainer()
    assert trainer.load(str(root / "step_2")) == 2
    resumed = run_steps(trainer, STEPS)
    assert all(rel(resumed[s], losses[s]) <= 1e-6 for s in range(3, STEPS + 1)), (resumed, losses)


def test_a_killed_checkpoint_write_keeps_the_last_good_one(single, tmp_path):
    env = dict(os.environ, MAMBAC_TEST_KILL_AT="after_write:3", OMP_NUM_THREADS="1")
    root, log = tmp_path / "ck", tmp_path / "log"
    proc = subprocess.run([sys.executable, str(SCRIPT), str(root), str(log), "--steps", "4"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (root / "step_3.tmp").is_dir() and not (root / "step_3").exists()
    assert latest_checkpoint(str(root)) == str(root / "step_2")
    assert [r["step"] for r in read_log(log)] == [1, 2]
    trainer = make_trainer()
    assert trainer.load(str(root)) == 2
    resumed = run_steps(trainer, 4)
    assert rel(resumed[3], single[1][3]) <= 1e-6 and rel(resumed[4], single[1][4]) <= 1e-6


def test_a_killed_rank_restarts_with_no_lost_or_repeated_step(restarted, single):
    rc, root, log = restarted
    assert rc == 0
    rows = read_log(log)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # the data stream went on where the checkpoint left it: batches 1..STEPS, none repeated or skipped
    assert [r["batch"] for r in rows] == [fingerprint(DATA.batch_at(s)[0]) for s in range(1, STEPS + 1)]
    # tp=2 and one process differ only by the order of floating-point sums
    assert all(rel(r["loss"], single[1][r["step"]]) <= 1e-5 for r in rows)


def test_a_tp2_checkpoint_resumes_on_one_process(restarted):
    rc, root, log = restarted
    logged = {r["step"]: r["loss"] for r in read_log(log)}
    trainer = make_trainer()
    assert trainer.load(str(root / "step_3")) == 3
    resumed = run_steps(trainer, STEPS)
    assert all(rel(resumed[s], logged[s]) <= 1e-6 for s in (4, 5)), (resumed, logged)


@pytest.fixture(scope="module")
def plain() -> Trainer:
    model = tiny_lm("mamba2", n_layer=1)
    return Trainer(mambac.compile(model), accum=2)


@pytest.mark.parametrize("ids, labels, match", [
    (torch.full((4, 8), 37), torch.zeros(4, 8, dtype=torch.long), r"token ids must lie in \[0, 37\).*37\.\.37"),
    (torch.full((4, 8), -1), torch.zeros(4, 8, dtype=torch.long), r"-1\.\.-1"),
    (torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.long), "integer token ids"),
    (torch.zeros(4, 8, 2, dtype=torch.long), torch.zeros(4, 8, 2, dtype=torch.long), r"\(batch, seqlen\)"),
    (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 7, dtype=torch.long), "differ in shape"),
    (torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long), "accum=2.*multiple of 2"),
    (torch.zeros(4, 8, dtype=torch.long), torch.full((4, 8), 40), r"labels must lie in \[0, 37\) or be -100"),
    (torch.zeros(4, 0, dtype=torch.long), torch.zeros(4, 0, dtype=torch.long), "no tokens"),
])
def test_bad_batches_are_refused_before_anything_runs(plain, ids, labels, match):
    before = [p.detach().clone() for p in plain.params.values()]
    with pytest.raises(MambacInputError, match=match):
        plain.step(ids, labels)
    assert plain.step_count == 0
    assert all(torch.equal(a, p) for a, p in zip(before, plain.params.values()))


@pytest.mark.parametrize("setting, match", [
    (dict(lr=-1e-3), "lr must be a positive number"), (dict(lr="1e-3"), "lr must be a positive number"),
    (dict(max_grad_norm=-1.0), "max_grad_norm must be a positive number, or None"),
    (dict(accum=1.5), "accum must be a positive number"), (dict(accum=0), "accum must be a positive number"),
    (dict(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"), (dict(weight_decay=-0.1), "weight_decay"),
    (dict(bf16="yes"), "bf16 must be True, False or None"), (dict(on_nonfinite="ignore"), "on_nonfinite"),
])
def test_bad_settings_are_refused_by_name(setting, match):
    with pytest.raises(MambacInputError, match=match):
        Trainer(mambac.compile(tiny_lm("mamba2", n_layer=1)), **setting)


def test_non_finite_gradients_stop_or_skip(plain):
    name, weight = next(iter(plain.params.items()))
    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    try:
        before = [p.detach().clone() for p in plain.params.values()]
        with pytest.raises(MambacRuntimeError, match=f"step 1: non-finite gradient of '{name}'"):
            plain.step(*DATA.batch_at(1))
        plain.on_nonfinite = "skip"
        plain.step(*DATA.batch_at(2))
        assert plain.skipped == 1
        assert all(torch.equal(a, p) for a, p in zip(before, plain.params.values()))
    finally:
        hook.remove()
        plain.on_nonfinite = "raise"
    plain.step(*DATA.batch_at(3))
    assert not torch.equal(before[0], weight)


def test_mambac_run_takes_max_restarts():
    from mambac.cli import build_parser
    args = build_parser().parse_args(["run", "-n", "2", "--max-restarts", "3", "train.py", "x"])
    assert (args.nprocs, args.max_restarts, args.script, args.args) == (2, 3, "train.py", ["x"])


def test_labels_may_be_ignored(plain):
    ids, labels = DATA.batch_at(4)
    labels[:, :3] = -100
    plain.check_batch(ids, labels)


def test_a_micro_batch_must_give_every_dp_rank_a_row():
    # checking a batch needs no process group: the module is compiled for dp=2 but not run
    trainer = Trainer(mambac.compile(tiny_lm("mamba2", n_layer=1), world_size=2, dp=2), accum=2)
    trainer.check_batch(*SyntheticTokens(vocab=37, batch=6, seqlen=4).batch_at(1))  # 3 rows per micro-batch: 2 + 1
    with pytest.raises(MambacInputError, match=r"micro-batch of 1 rows.*dp=2.*at least 4 rows"):
        trainer.check_batch(*SyntheticTokens(vocab=37, batch=2, seqlen=4).batch_at(1))


class FakeCuda:
    """The checkpoint's three calls into torch.cuda's generators, as on a machine with ``n`` devices."""

    def __init__(self, n: int) -> None:
        self.n, self.states, self.set = n, [torch.randint(0, 255, (16,), dtype=torch.uint8) for _ in range(n)], None

    def install(self, monkeypatch) -> None:
        import mambac.trainer_checkpoint as ck
        monkeypatch.setattr(ck, "_cuda_devices", lambda: self.n)
        monkeypatch.setattr(ck, "_cuda_rng_states", lambda: [s.clone() for s in self.states])
        monkeypatch.setattr(ck, "_set_cuda_rng_states", lambda states: setattr(self, "set", list(states)))


def test_cuda_generators_are_saved_and_restored_when_the_devices_match(plain, tmp_path, monkeypatch):
    import warnings
    saved = FakeCuda(2)
    with monkeypatch.context() as m:
        saved.install(m)
        plain.save(str(tmp_path))
    cpu = torch.get_rng_state()
    for n, restored in ((2, "cpu+cuda"), (1, "cpu")):
        now = FakeCuda(n)
        with monkeypatch.context() as m, warnings.catch_warnings():
            warnings.simplefilter("error")  # the fallback is silent
            now.install(m)
            torch.manual_seed(7)
            plain.load(str(tmp_path))
        assert plain.rng_restored == restored and torch.equal(torch.get_rng_state(), cpu)
        if n == 2:
            assert [s.tolist() for s in now.set] == [s.tolist() for s in saved.states]
        else:
            assert now.set is None  # 2 saved device generators do not fit 1 device: left as seeded


def test_a_checkpoint_of_another_model_is_refused(plain, tmp_path):
    other = Trainer(mambac.compile(tiny_lm("mamba1", n_layer=1)))
    other.save(str(tmp_path))
    with pytest.raises(MambacRuntimeError, match="does not match this model: it lacks"):
        plain.load(str(tmp_path))


def test_bf16_autocast_keeps_fp32_master_weights_and_tracks_fp32_training():
    from mambac.trainer import SyntheticTokens
    data = SyntheticTokens(vocab=37, batch=4, seqlen=8)
    runs = {}
    for bf16 in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(mambac.compile(tiny_lm("mamba2", n_layer=1)), lr=3e-3, bf16=bf16)
        runs[bf16] = [trainer.step(*data.batch_at(s)) for s in (1, 2, 3)]
        assert all(p.dtype == torch.float32 for p in trainer.params.values())   # master weights stay fp32
        assert all(st["exp_avg"].dtype == torch.float32 for st in trainer.opt.state.values())
    assert all(rel(b, f) <= 2e-2 for b, f in zip(runs[True], runs[False])), runs
    assert runs[True] != runs[False]   # the forward really ran in bf16


def test_clip_grad_norm_refuses_a_norm_that_would_flip_the_gradients():
    model = tiny_lm("mamba2", n_layer=1)
    with pytest.raises(MambacInputError, match="max_norm must be a positive number, got -1.0"):
        mambac.clip_grad_norm_(model, -1.0)
    assert float(mambac.clip_grad_norm_(model, 1.0)) == 0.0   # no gradients yet: a zero norm, nothing changed
