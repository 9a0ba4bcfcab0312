"""The CLI's context-parallel flags and `mambac bench`."""
import pytest

from mambac.cli import main


def test_dump_context_parallel_rank(capsys):
    assert main(["dump", "mamba2-tiny", "--world-size", "4", "--tp", "2", "--cp", "2", "--rank", "3",
                 "--seqlen", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# mambac graph after 'eliminate_dead_code' (rank 3 of 4)")
    assert out.count("# mambac graph after") == 1          # the last stage only
    assert "context_parallel.cp_ssd(" in out and "context_parallel.cp_causal_conv1d(" in out
    assert "1, 2, 'cp')" in out                            # rank 3 is cp rank 1 of 2


def test_explain_context_parallel_formulas(capsys):
    assert main(["explain", "mamba2-tiny", "--world-size", "2", "--cp", "2", "--rank", "0", "--seqlen", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== rank 0 of 2 ===")
    assert "cp_exchange" in out
    cp_total = next(ln for ln in out.splitlines() if ln.strip().startswith("total over cp:"))
    assert "batch" in cp_total and "seqlen" not in cp_total   # the cp payload does not grow with the length


def test_bench_lists_and_rejects_unknown(capsys):
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "cp" in out and "ssd" in out
    assert main(["bench", "no-such-bench"]) == 2
    assert "no benchmark 'no-such-bench'" in capsys.readouterr().err


def test_bench_runs_a_script(capfd):
    assert main(["bench", "cp", "--tiny"]) == 0
    out = capfd.readouterr().out
    assert "| fwd+bwd |" in out and "rel err 0.0e+00" in out


@pytest.mark.parametrize("name, says", [
    ("ssd", "bench_ssd measures the generated kernels on a CUDA GPU"),
    ("scans", "bench_scans measures the scan kernels on a CUDA GPU"),
    ("train", "--tiny runs a tiny LM on the CPU"),
])
def test_gpu_benchmarks_say_so_on_a_cpu_machine(name, says, capfd, monkeypatch):
    """Full-size GPU benchmarks stop with one sentence where there is no GPU (instead of a cascade
    of Triton driver errors, or hours of a 130M model on the CPU).  The script's process is shown no
    GPU (CUDA_VISIBLE_DEVICES empty), so this runs on GPU machines too."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["bench", name]) != 0
    captured = capfd.readouterr()
    assert says in captured.err and "Traceback" not in captured.err
