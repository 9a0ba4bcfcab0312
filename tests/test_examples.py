"""Every example runs, with a tiny configuration."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: int = 300) -> str:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_compile_hf_checkpoint(tmp_path):
    out = _run("examples/compile_hf_checkpoint.py", "--dir", str(tmp_path), "--layers", "1")
    assert "rel err vs transformers" in out
    assert (tmp_path / "config.json").exists()


def test_torch_compile_backend():
    assert "after 6 steps" in _run("examples/torch_compile_backend.py", "--steps", "6")


def test_train_tensor_parallel_two_ranks(tmp_path):
    save = tmp_path / "full.pt"
    out = _run("-m", "mambac.cli", "run", "-n", "2", "--timeout", "240", "examples/train_tensor_parallel.py",
               "--steps", "3", "--sequence-parallel", "--save", str(save))
    assert "world 2 (tp=2, dp=1, cp=1)" in out
    import torch
    assert "lm_head.weight" in torch.load(save)


def test_train_tensor_by_context_parallel_four_ranks():
    out = _run("-m", "mambac.cli", "run", "-n", "4", "--timeout", "240", "examples/train_tensor_parallel.py",
               "--steps", "3", "--tp", "2", "--cp", "2")
    assert "world 4 (tp=2, dp=1, cp=2)" in out


def test_train_long_context_two_ranks():
    out = _run("-m", "mambac.cli", "run", "-n", "2", "--timeout", "240", "examples/train_long_context.py",
               "--seqlen", "2048", "--steps", "2")
    assert "cp=2" in out and "saved activations per rank" in out
