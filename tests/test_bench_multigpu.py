"""benchmarks/bench_multigpu.py runs (tiny models, gloo) and its correctness table holds."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def correctness_rows(ranks: int, timeout: int) -> list[str]:
    """The table rows of ``bench_multigpu.py correctness --tiny`` on ``ranks`` gloo ranks."""
    r = subprocess.run([sys.executable, "-m", "mambac.cli", "run", "-n", str(ranks), "--timeout", str(timeout),
                        "benchmarks/bench_multigpu.py", "correctness", "--tiny"], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout + 60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| mamba")]
    assert all(ln.endswith("| yes |") for ln in rows), r.stdout
    return rows


def test_correctness_table_on_four_ranks():
    """Every layout of the table, the two-dimensional meshes tp x cp (2 x 2) and dp x tp (2 x 2)
    included, for Mamba-2 and Mamba-3 (the other modes run on two ranks below)."""
    rows = correctness_rows(4, 300)
    assert len(rows) == 10
    assert {ln.split("|")[2].strip() for ln in rows} == {"tp", "tp+sp", "cp", "tp x cp", "dp x tp"}


def test_scaling_longctx_and_overlap_modes_run():
    """The measuring modes run end to end, one after the other in one launch on two gloo ranks,
    and print their one-row tables."""
    r = subprocess.run([sys.executable, "-m", "mambac.cli", "run", "-n", "2", "--timeout", "300",
                        "benchmarks/bench_multigpu.py", "scaling", "longctx", "overlap", "--layout", "cp", "--tiny",
                        "--steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    for title, head in (("scaling on 2", "| tiny Mamba-2 | 2 |"), ("longctx on 2", "| tiny Mamba-2 | 2 | 256 |"),
                        ("overlap on 2", "| cp | 2 |")):
        assert any(ln.startswith(title) for ln in lines) and any(ln.startswith(head) for ln in lines), r.stdout
