import subprocess
import sys
import textwrap

import pytest

from mambac.cli import main


def test_dump_preset_stage(capsys):
    assert main(["dump", "mamba2-tiny", "--stage", "fuse_ssm", "--seqlen", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# mambac graph after 'fuse_ssm' (rank 0 of 1)")
    assert "mambac.ssd(" in out and "fused: dt_prologue+d_skip" in out


def test_dump_all_stages_in_order(capsys):
    assert main(["dump", "mamba1-tiny", "--stage", "all", "--seqlen", "8"]) == 0
    out = capsys.readouterr().out
    heads = [ln for ln in out.splitlines() if ln.startswith("# mambac graph after")]
    assert [h.split("'")[1] for h in heads] == ["capture", "canonicalize", "fuse_ssm", "fuse_loss", "eliminate_dead_code"]


def test_dump_factory_file_to_dot(tmp_path):
    f = tmp_path / "mymodel.py"
    f.write_text(textwrap.dedent("""
        from mambac.presets import build_preset
        def make():
            return build_preset("mamba1-tiny")
    """))
    out = tmp_path / "g.dot"
    assert main(["dump", f"{f}:make", "--format", "dot", "-o", str(out), "--seqlen", "8"]) == 0
    assert out.read_text().startswith('digraph "eliminate_dead_code"')


def test_errors_are_one_clear_line(capsys):
    assert main(["dump", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mambac: error: cannot resolve model 'no-such-model'")
    assert main(["dump", "mamba2-tiny", "--stage", "bogus", "--seqlen", "8"]) == 2
    assert "no stage 'bogus'" in capsys.readouterr().err


def test_console_script_and_demo(tmp_path):
    exe = [sys.executable, "-m", "mambac.cli"]
    r = subprocess.run(exe + ["demo", "--graph-out", str(tmp_path / "g.txt"), "--steps", "4", "--batch", "8",
                              "--world-size", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "parity vs eager" in r.stdout and "-> OK" in r.stdout
    assert (tmp_path / "g.txt").read_text().startswith("# mambac graph after")


def test_dump_every_rank_of_a_tensor_parallel_program(capsys):
    assert main(["dump", "mamba2-tiny", "--world-size", "2", "--rank", "1", "--seqlen", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# mambac graph after") and "(rank 1 of 2)" in out.splitlines()[0]
    assert "all_reduce" in out
    assert main(["dump", "mamba2-tiny", "--world-size", "2", "--rank", "2"]) == 2
    assert "--rank 2 is not a rank" in capsys.readouterr().err


def test_dump_checkpoint_directory(tmp_path, capsys):
    import json

    import torch

    from mambac.presets import build_preset
    model = build_preset("mamba1-tiny")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert main(["dump", str(tmp_path), "--seqlen", "8"]) == 0
    assert "mambac.selective_scan(" in capsys.readouterr().out


def test_run_launches_ranks(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os, sys\n"
                      "r, w = os.environ['RANK'], os.environ['WORLD_SIZE']\n"
                      f"open(os.path.join({str(tmp_path)!r}, 'rank' + r), 'w').write(r + ' of ' + w)\n")
    r = subprocess.run([sys.executable, "-m", "mambac.cli", "run", "-n", "2", "--timeout", "120", str(script)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "rank0").read_text() == "0 of 2" and (tmp_path / "rank1").read_text() == "1 of 2"


def test_explain_reports_parameters_communication_kernels_and_memory(capsys):
    assert main(["explain", "mamba2-tiny", "--world-size", "2", "--rank", "1", "--seqlen", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== rank 1 of 2 ===")
    for part in ("parameters held by this rank", "communication per step", "all_reduce", "kernels (fused ops):",
                 "ssd [dt_prologue+d_skip]", "saved for backward", "*B*L"):
        assert part in out, part
    assert main(["explain", "mamba1-tiny", "--remat", "auto", "--memory-budget", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err


def test_explain_single_rank_with_remat(capsys):
    assert main(["explain", "mamba1-tiny", "--remat", "full", "--seqlen", "16"]) == 0
    out = capsys.readouterr().out
    assert "communication: none (single rank)" in out and "remat='full'" in out and "recomputed in backward: 2 regions" in out
    assert "2 x selective_scan [delta_prologue+d_skip+z_gate]" in out  # ops inside recompute regions count


def test_dot_draws_the_stage_asked_for(capsys):
    assert main(["dump", "mamba2-tiny", "--stage", "capture", "--format", "dot", "--seqlen", "8"]) == 0
    capture = capsys.readouterr().out
    assert capture.startswith('digraph "capture"') and "fused:" not in capture  # the graph before fuse_ssm
    assert main(["dump", "mamba2-tiny", "--stage", "fuse_ssm", "--format", "dot", "--seqlen", "8"]) == 0
    assert "fused: dt_prologue" in capsys.readouterr().out
    assert main(["dump", "mamba2-tiny", "--stage", "all", "--format", "dot", "--seqlen", "8"]) == 0
    heads = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("digraph")]
    assert heads[0] == 'digraph "capture" {' and heads[-1] == 'digraph "eliminate_dead_code" {' and len(heads) == 5


def test_svg_goes_through_graphviz_or_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` on PATH
    assert main(["dump", "mamba2-tiny", "--format", "svg", "--seqlen", "8"]) == 2
    err = capsys.readouterr().err
    assert "needs Graphviz's `dot` program" in err and "apt-get install graphviz" in err
    fake = tmp_path / "dot"  # a stand-in `dot` that wraps its input, to check what is piped to it
    fake.write_text(f"#!{sys.executable}\nimport sys\nsrc = sys.stdin.read()\n"
                    "print('<svg><!--' + sys.argv[1] + ' ' + src.splitlines()[0] + '--></svg>')\n")
    fake.chmod(0o755)
    out = tmp_path / "g.svg"
    assert main(["dump", "mamba2-tiny", "--stage", "fuse_ssm", "--format", "svg", "-o", str(out), "--seqlen", "8"]) == 0
    assert out.read_text().strip() == '<svg><!---Tsvg digraph "fuse_ssm" {--></svg>'
    assert main(["dump", "mamba2-tiny", "--stage", "all", "--format", "svg", "--seqlen", "8"]) == 2
    assert "--format svg draws one stage" in capsys.readouterr().err


def test_dump_hf_checkpoint_directory(tmp_path, capsys):
    from tests.convert.hf_models import hf_model
    hf_model("mamba2_lm_groups").save_pretrained(tmp_path)
    assert main(["dump", str(tmp_path), "--seqlen", "8"]) == 0
    out = capsys.readouterr().out
    assert "mambac.ssd(" in out and "fused: dt_prologue" in out


def test_dump_shows_recompute_regions_and_explain_meets_a_budget(capsys):
    assert main(["dump", "mamba2-tiny", "--remat", "full", "--stage", "plan_remat", "--seqlen", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# mambac graph after 'plan_remat'") and out.count("remat_") >= 2
    assert main(["explain", "mamba2-tiny", "--remat", "auto", "--memory-budget", "512KiB", "--seqlen", "64"]) == 0
    out = capsys.readouterr().out
    assert "remat='auto'" in out and "recomputed in backward: " in out, out
    budget = next(ln for ln in out.splitlines() if ln.strip().startswith("budget"))
    assert "512.00 KiB" in budget and "(met;" in budget, budget


def test_mambac_logs_sets_up_logging_on_import():
    code = ("import logging, mambac; lg = logging.getLogger('mambac'); "
            "print(lg.level, [h.get_name() for h in lg.handlers]); "
            "logging.getLogger('mambac.passes').info('hello from the passes')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "MAMBAC_LOGS": "info"})
    assert r.returncode == 0 and r.stdout.split()[0] == "20" and "mambac-logs" in r.stdout, r.stderr
    assert "mambac.passes INFO hello from the passes" in r.stderr
    r = subprocess.run([sys.executable, "-c", "import mambac"], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "MAMBAC_LOGS": "loud"})
    assert r.returncode != 0 and "MAMBAC_LOGS='loud' is not a logging level" in r.stderr


@pytest.mark.parametrize("argv,message", [
    (["dump", "mamba2-tiny", "--seqlen", "-5"], "argument --seqlen: must be a positive integer, got -5"),
    (["explain", "mamba2-tiny", "--seqlen", "0"], "argument --seqlen: must be a positive integer, got 0"),
    (["explain", "mamba2-tiny", "--batch", "two"], "argument --batch: expected a positive integer, got 'two'"),
    (["dump", "mamba2-tiny", "--world-size", "0"], "argument --world-size: must be a positive integer"),
    (["dump", "mamba2-tiny", "--rank", "-1"], "argument --rank: must not be negative, got -1"),
    (["plan", "mamba2-tiny", "--top", "0"], "argument --top: must be a positive integer"),
    (["run", "-n", "2", "--timeout", "-1", "x.py"], "argument --timeout: must be a positive number of seconds"),
    (["run", "-n", "2", "--max-restarts", "-1", "x.py"], "argument --max-restarts: must not be negative"),
    (["demo", "--lr", "-1"], "argument --lr: must be a positive number, got -1"),
    (["demo", "--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["demo", "--world-size", "0"], "argument --world-size: must be a positive integer"),
])
def test_counts_sizes_and_ranks_are_checked_as_they_are_parsed(argv, message, capsys):
    """Sizes, counts and ranks that cannot be (zero or negative lengths, a negative rank) stop at
    the argument parser with the option's name, before any model is loaded."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_explain_refuses_a_rank_outside_the_world(capsys):
    assert main(["explain", "mamba2-tiny", "--rank", "3"]) == 2
    assert "--rank 3 is not a rank of --world-size 1" in capsys.readouterr().err
