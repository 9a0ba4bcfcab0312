import subprocess
import sys
import textwrap

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
    assert [h.split("'")[1] for h in heads] == ["capture", "canonicalize", "fuse_ssm", "eliminate_dead_code"]


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
    r = subprocess.run(exe + ["demo", "--graph-out", str(tmp_path / "g.txt"), "--steps", "4", "--batch", "8"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "parity vs eager" in r.stdout and "-> OK" in r.stdout
    assert (tmp_path / "g.txt").read_text().startswith("# mambac graph after")
