"""Writer, on-disk cache, compile stages (with repro on failure) and persistent autotune."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from mambac import knobs
from mambac.codegen import autotune, cache
from mambac.codegen.compile import STAGES, CodegenError, load_kernel
from mambac.codegen.kernel_ir import TileConfig, region_for
from mambac.codegen.writer import Writer


def test_writer_indents_blocks_and_rejects_bad_headers():
    w = Writer()
    with w.block("def f(a):"):
        w.comment("why")
        with w.block("for i in range(a):"):
            w.line("a += i")
        w.line("return a")
    assert w.source() == "def f(a):\n    # why\n    for i in range(a):\n        a += i\n    return a\n"
    with pytest.raises(ValueError, match="must end with ':'"):
        with w.block("def g()"):
            pass


def test_cache_is_keyed_by_content(tmp_path):
    with knobs.override(cache_dir=str(tmp_path)):
        p1 = cache.write_source("k", "A = 1\n")
        p2 = cache.write_source("k", "A = 2\n")
        assert p1 != p2 and p1.read_text() == "A = 1\n" and p1.parent.parent == tmp_path / "kernels"
        assert cache.write_source("k", "A = 1\n") == p1
        cache.save_choice("fam", "key1", "v1")
        cache.save_choice("fam", "key2", "v2")
        assert cache.load_choices("fam") == {"key1": "v1", "key2": "v2"}
        assert cache.load_choices("missing") == {}


def test_load_kernel_runs_stages_in_order(tmp_path):
    with knobs.override(cache_dir=str(tmp_path)):
        k = load_kernel("my_kernel", lambda: "def my_kernel():\n    return 42\n")
    assert k.stage_log == list(STAGES[:3]) and k.fn() == 42
    assert k.path.read_text().startswith("def my_kernel")


def test_import_failure_leaves_a_runnable_repro(tmp_path):
    with knobs.override(cache_dir=str(tmp_path)):
        with pytest.raises(CodegenError, match="stage 'import'") as info:
            load_kernel("broken", lambda: "def broken(:\n")
    repro = str(info.value).split("repro: python ")[1].strip()
    proc = subprocess.run([sys.executable, repro], capture_output=True, text=True)
    assert proc.returncode != 0 and "SyntaxError" in proc.stderr


def test_render_failure_names_a_repro(tmp_path):
    def bad_render():
        raise KeyError("no such flag")

    with knobs.override(cache_dir=str(tmp_path)):
        with pytest.raises(CodegenError, match="stage 'render'.*KeyError") as info:
            load_kernel("never", bad_render)
    assert "no such flag" in open(str(info.value).split("repro: python ")[1].strip()).read()


FAKE_LAUNCHER = """
CALLS = []


class _Kernel:
    def __getitem__(self, grid):
        def run(*args, **kwargs):
            CALLS.append((grid, args, kwargs))
            if kwargs.get("FAIL"):
                raise RuntimeError("launch refused")
        return run


fake_launch = _Kernel()
"""


def test_launch_passes_a_register_cap_only_when_set(tmp_path):
    with knobs.override(cache_dir=str(tmp_path)):
        k = load_kernel("fake_launch", lambda: FAKE_LAUNCHER)
        k.launch((2, 1), [3], {"BM": 16}, TileConfig(num_warps=4, num_stages=2))
        k.launch((2, 1), [3], {"BM": 16}, TileConfig(num_warps=8, num_stages=3, maxnreg=128))
        assert k.module.CALLS == [((2, 1), (3,), dict(BM=16, num_warps=4, num_stages=2)),
                                  ((2, 1), (3,), dict(BM=16, num_warps=8, num_stages=3, maxnreg=128))]
        with pytest.raises(CodegenError, match="launch refused") as info:
            k.launch((1,), [], {"FAIL": 1}, TileConfig(num_warps=4, num_stages=2, maxnreg=96))
    repro = open(str(info.value).split("repro:  python ")[1].strip()).read()
    assert "'num_warps': 4, 'num_stages': 2, 'maxnreg': 96" in repro


def test_tile_config_json_keeps_old_keys_without_a_register_cap():
    plain = TileConfig(block_m=32, heads=2)
    assert "maxnreg" not in json.loads(plain.to_json())
    capped = TileConfig(block_m=32, num_stages=2, maxnreg=128)
    assert json.loads(capped.to_json())["maxnreg"] == 128
    assert TileConfig.from_json(plain.to_json()) == plain and TileConfig.from_json(capped.to_json()) == capped


def test_autotune_measures_once_and_persists(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune, "device_name", lambda: "FakeGPU")
    cands = [TileConfig(block_m=16), TileConfig(block_m=32), TileConfig(block_m=64)]
    calls = []

    def bench(cfg):
        calls.append(cfg.block_m)
        if cfg.block_m == 64:
            raise RuntimeError("out of shared memory")
        return 1.0 / cfg.block_m

    with knobs.override(cache_dir=str(tmp_path)):
        fam = autotune.family_key("k", ["src"], cands)
        assert autotune.choose(fam, "b1", cands, bench) == cands[1]
        assert calls == [16, 32, 64]
        autotune._CHOSEN.clear()  # a new process: only the disk remembers
        assert autotune.choose(fam, "b1", cands, bench) == cands[1]
        assert calls == [16, 32, 64]
        stored = json.loads(cache.autotune_file(fam).read_text())
        assert list(stored) == ["b1|FakeGPU"]
    assert autotune.family_key("k", ["other src"], cands) != fam


def test_autotune_of_an_in_place_kernel_times_the_tuning_launch(tmp_path, monkeypatch):
    """run_family times candidates through ``tuning_launch`` (made once, only when timing), and
    launches the chosen config through ``launch`` only: the caller's data is written once."""
    from mambac.codegen import ssd_launch
    monkeypatch.setattr(autotune, "interpreting", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(autotune, "device_name", lambda: "FakeGPU")
    monkeypatch.setattr(autotune, "time_ms", lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(ssd_launch, "kernel_of", lambda fam, region, cfg: f"kernel{cfg.block_m}")
    fam = ssd_launch.Family("inplace", lambda r, c: f"src{c.block_m}",
                            lambda d: [TileConfig(block_m=16), TileConfig(block_m=32)])
    dims = ssd_launch.Dims(b=1, l=8, h=1, g=1, p=4, n=4, q=8)
    real, scratch, made = [], [], []

    def tuning():
        made.append(1)
        return lambda kern, cfg: scratch.append(kern)

    with knobs.override(cache_dir=str(tmp_path)):
        ssd_launch.run_family(fam, "region", dims, lambda kern, cfg: real.append(kern), tuning_launch=tuning)
        ssd_launch.run_family(fam, "region", dims, lambda kern, cfg: real.append(kern), tuning_launch=tuning)
    assert made == [1] and scratch == ["kernel16", "kernel32"] and real == ["kernel16", "kernel16"]
    ssd_launch._PLANS.pop(("inplace", "region", dims))


def test_region_from_call_arguments():
    x = torch.zeros(1, 4, 2, 3, dtype=torch.bfloat16)
    r = region_for(x, 8, D=torch.zeros(2, 3), z=None, dt_bias=torch.zeros(2), initial_state=None,
                   dt_softplus=True, dt_min=0.0, dt_max=float("inf"))
    assert (r.d_mode, r.has_dt_bias, r.dt_clamp, r.has_z, r.io_dtype) == ("head_dim", True, False,
                                                                            False, "bf16")
    assert region_for(x, 8, D=None, z=None, dt_bias=None, initial_state=None, dt_softplus=False,
                      dt_min=0.1, dt_max=float("inf")).dt_clamp
    with pytest.raises(ValueError, match="no generated SSD kernels"):
        region_for(x.double(), 8, D=None, z=None, dt_bias=None, initial_state=None,
                   dt_softplus=False, dt_min=0.0, dt_max=float("inf"))


def test_register_cuda_kernels_is_idempotent():
    from mambac.codegen import register_cuda_kernels
    register_cuda_kernels()
    register_cuda_kernels()
    x = torch.randn(1, 5, 2, 4, dtype=torch.float64)
    y, final = torch.ops.mambac.ssd(x, torch.rand(1, 5, 2, dtype=torch.float64), -torch.rand(2),
                                    torch.randn(1, 5, 1, 3), torch.randn(1, 5, 1, 3), None, None,
                                    None, None, 4, False, 0.0, float("inf"))
    assert y.shape == x.shape and final.shape == (1, 2, 4, 3)  # CPU still runs the reference


@pytest.mark.parametrize("h,g,p,n", [(48, 1, 64, 128), (64, 8, 64, 128), (6, 3, 48, 96), (5, 5, 256, 64)])
def test_gpu_tile_candidates_fit_the_shape(monkeypatch, h, g, p, n):
    """Every GPU candidate divides the heads it unrolls or splits, and tiles are tl.dot-sized."""
    from mambac.codegen import ssd_launch as sl
    monkeypatch.setattr(autotune, "interpreting", lambda: False)
    d = sl.Dims(b=2, l=1000, h=h, g=g, p=p, n=n, q=256)
    for cands in (sl.head_block_candidates(d), sl.dx_candidates(d), sl.group_candidates(d),
                  sl.chunk_state_candidates(d), sl.dstate_candidates(d)):
        assert cands
        for c in cands:
            assert d.hpg % c.splits == 0 and (d.hpg // c.splits) % c.heads == 0
            assert c.block_m >= 16 and c.block_k >= 16


def test_host_overhead_benchmark_prints_its_table():
    """benchmarks/ssd_host_overhead.py runs anywhere (launches stubbed) and prints one row per path."""
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ssd_host_overhead.py"
    r = subprocess.run([sys.executable, str(script), "--calls", "3"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| forward")]
    assert len(rows) == 2 and all(float(ln.split("|")[2]) > 0 for ln in rows), r.stdout


def test_remat_host_overhead_benchmark_prints_its_table():
    """benchmarks/remat_host_overhead.py runs anywhere (launches stubbed): one row per remat mode and
    way of running the regions, 'none' recomputing nothing and the other two recomputing regions."""
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "remat_host_overhead.py"
    r = subprocess.run([sys.executable, str(script), "--layers", "2", "--steps", "1"], capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): ln.split("|")[3:5] for ln in r.stdout.splitlines()
            if ln.startswith(("| none", "| auto", "| full"))}
    assert set(rows) == {("none", "-"), ("auto", "replay"), ("auto", "checkpoint"), ("full", "replay"),
                         ("full", "checkpoint")}, r.stdout
    assert int(rows[("none", "-")][0]) == 0 and int(rows[("auto", "replay")][0]) > 0
    assert int(rows[("full", "replay")][0]) == 2
    assert all(float(ms) > 0 for _, ms in rows.values())
