"""The kernels the interpreter cannot fully check (the SSD kernels' tensor-descriptor forms, which
only run on a GPU, the cp fold forms with and without descriptors, the state walks and the state
pass, the cp exchange's small kernels, dC's form that adds the exchange's decay-gradient parts) compile for Hopper (sm_90) with Triton's own compiler, on
this machine, GPU or not (``compile_hopper.py``, run in a process of its own with the interpreter
off)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("compile_hopper.py")


def test_generated_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton"), MAMBAC_CACHE_DIR=str(tmp_path / "mambac"),
               TRITON_DEFAULT_FP_FUSION="1")
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=400)
    compiled = [line.split()[1] for line in run.stdout.splitlines() if line.startswith("compiled ")]
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert compiled == ["ssd_chunk_scan_fold", "ssd_dx_fold", "ssd_db_fold", "ssd_dc_part",
                        "ssd_chunk_scan_fold_tma", "ssd_dx_fold_tma", "ssd_db_fold_tma", "ssd_dc_part_tma",
                        "ssd_chunk_state_tma", "ssd_state_walk", "ssd_state_walk:whole-chunk-blocks",
                        "ssd_state_pass", "ssd_chunk_scan_tma", "ssd_chunk_scan_tma:square", "ssd_gate_backward_tma", "ssd_chunk_dstate_tma",
                        "ssd_state_walk_bwd", "ssd_dx_tma", "ssd_dcb_tma", "ssd_dc_tma", "ssd_db_tma",
                        "cp_incoming", "cp_incoming_without_final", "cp_outgoing"]
