"""The main job as `make demo` runs it: 4 gloo ranks, tp=2 x cp=2, 250 steps of selective copying and
induction heads; the held-out accuracy must reach the high nineties and the trained model must
match eager."""
import os
import re
import subprocess
import sys


def test_make_demo_trains_to_high_accuracy_at_tp2_cp2(tmp_path):
    graph = tmp_path / "graph.txt"
    env = {**os.environ, "MAMBAC_PROGRESS": "0"}
    r = subprocess.run([sys.executable, "-m", "mambac.demo", "--graph-out", str(graph)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "world_size 4 (tp=2 x cp=2)" in r.stdout and "on cpu" in r.stdout
    acc = float(re.search(r"held-out accuracy ([\d.]+)%", r.stdout).group(1))
    assert acc >= 95.0, r.stdout
    assert "-> OK" in r.stdout
    text = graph.read_text()
    assert text.startswith("# mambac graph after") and "(rank 0 of 4)" in text.splitlines()[0] and "cp_ssd" in text


def test_demo_device_choice():
    from mambac.demo import _without_option, pick_device
    assert pick_device("cpu", 4) == "cpu"
    assert pick_device("auto", 4) in ("cpu", "cuda")
    assert _without_option(["--steps", "3", "--device", "cuda", "--device=cpu", "--batch", "2"], "--device") == \
        ["--steps", "3", "--batch", "2"]
