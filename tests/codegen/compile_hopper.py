"""Compile generated kernels for Hopper (sm_90) with Triton's own compiler, on any machine.

Run as a script in a process where the Triton interpreter is off (``TRITON_INTERPRET`` unset):
the interpreter runs a kernel's Python, so it never sees what the compiler checks (types,
tensor-descriptor loads, the TMA forms, which only run on a GPU).  Prints ``compiled NAME`` per
kernel and ``failed NAME: error`` for a kernel that does not compile; exits 1 if any failed.

Covered: context parallelism's fold forms (chunk scan, dx, dB; with and without tensor
descriptors), the SSD kernels that take tensor descriptors on Hopper (chunk state, chunk scan, the
gate backward, the state walks both ways, dstate, dx, dcb, dC, dB), the state pass, and the two
small kernels of ``codegen/cp_combine_kernels.py``; bf16 io at headdim 64 / dstate 128, chunk 256.
"""
from __future__ import annotations

import os
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mambac.codegen import cp_combine_kernels, render_bwd_pairs, render_bwd_tiles, render_fwd, render_state_walk
from mambac.codegen.compile import load_kernel
from mambac.codegen.kernel_ir import SSDRegion

REGION = SSDRegion(has_dt_bias=True, dt_softplus=True, dt_clamp=False, d_mode="head", has_z=True,
                   has_initial_state=False, io_dtype="bf16", chunk_size=256)
# pointers to fp32 data; every other pointer is to the io dtype (bf16)
FP32 = {"d_ptr", "dd_ptr", "dtp_ptr", "cs_ptr", "fw_ptr", "ddtd_ptr", "dcb_ptr", "out_ptr", "v_ptr", "es_ptr",
        "final_ptr", "a_ptr", "bias_ptr", "dt_ptr", "cb_ptr", "states_ptr", "dst_ptr", "dfinal_ptr",
        "dinit_ptr", "dtot_ptr", "mrow_ptr", "mcol_ptr"}
# the hand-written kernels' pointers (their names do not end in _ptr)
SMALL = {"G": "*fp32", "CS": "*fp32", "F0": "*fp32", "FINAL": "*fp32", "FW": "*fp32", "E": "*fp32",
         "TOT": "*fp32", "TOTALS": "*fp32", "PARTS": "*fp32", "FS": "*bf16", "SIN": "*bf16", "GS": "*bf16"}
SCAN = dict(BM=64, BK=32, PP=64, NP=128, EVEN=True)
# block shapes of the tensor descriptors, as the launchers make them at these sizes (BM / BT 64, BK / BS 32)
SCAN_DESCRIPTORS = {"xd": (32, 64), "cd": (64, 128), "sd": (64, 128), "cbd": (64, 32), "yd": (64, 64)}
DX_DESCRIPTORS = {"bd": (64, 128), "dsd": (64, 128), "cbd": (64, 32), "dyd": (32, 64)}
DB_DESCRIPTORS = {"ownd": (64, 128), "hd": (64, 64), "sd": (64, 128), "otherd": (32, 128), "dcbd": (32, 64)}
DC_DESCRIPTORS = dict(DB_DESCRIPTORS, dcbd=(64, 32))
WALK_DESCRIPTORS = {"xd": (32, 32), "bd": (32, 64), "sind": (32, 64)}
DESCRIPTOR_DTYPE = {"cbd": "fp32", "dcbd": "fp32"}


def _kernel(name: str, source: str) -> triton.runtime.jit.JITFunction:
    """The kernel ``name`` of a generated source, stored and imported as the launchers do."""
    return load_kernel(name, lambda: source, REGION.summary()).fn


def _type(name: str, constexprs: dict, descriptors: dict, pointers: dict) -> str:
    if name in pointers:
        return pointers[name]
    if name in constexprs:
        return "constexpr"
    if name in descriptors:
        shape = ", ".join(str(s) for s in descriptors[name])
        return f"tensordesc<{DESCRIPTOR_DTYPE.get(name, 'bf16')}[{shape}]>"
    if name in FP32:
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "i32"


def cases() -> list[tuple]:
    """(name, generated source or hand-written kernel, constexprs, descriptor block shapes[, pointer
    types]) of every kernel compiled; a generated kernel's own name is ``name`` without "_tma" and
    without what follows a colon (another tile of the same kernel)."""
    r, out = REGION, []
    tiles = dict(BT=64, BS=32, PP=64, NP=128, EVEN=True)
    for tma in (False, True):
        tag = "_tma" if tma else ""
        fsd = dict(fsd=(64, 128))   # the fold's (headdim x dstate) tile
        scan, dx, db = (dict(SCAN_DESCRIPTORS, **fsd), dict(DX_DESCRIPTORS, **fsd), dict(DB_DESCRIPTORS, **fsd)) \
            if tma else ({}, {}, {})
        out += [(f"ssd_chunk_scan_fold{tag}", render_fwd.render_chunk_scan(r, 1, "forward", tma, fold=True),
                 SCAN, scan),
                (f"ssd_dx_fold{tag}", render_bwd_tiles.render_dx(r, 1, tma, fold=True), SCAN, dx),
                (f"ssd_db_fold{tag}", render_bwd_tiles.render_dbc(r, "b", tma, fold=True), tiles, db),
                (f"ssd_dc_part{tag}", render_bwd_tiles.render_dbc(r, "c", tma, part=True), tiles,
                 DC_DESCRIPTORS if tma else {})]
    out += [("ssd_chunk_state_tma", render_fwd.render_chunk_state(r, "forward", 1, True),
             dict(BT=32, BP=64, NP=128), {"xd": (32, 64), "bd": (32, 128)}),
            ("ssd_state_walk", render_state_walk.render_state_walk(r),
             dict(BT=32, BP=32, BN=64, P=64, N=128), WALK_DESCRIPTORS),
            ("ssd_state_walk:whole-chunk-blocks", render_state_walk.render_state_walk(r),
             dict(BT=256, BP=32, BN=64, P=64, N=128), {"xd": (256, 32), "bd": (256, 64), "sind": (32, 64)}),
            ("ssd_state_pass", render_fwd.render_state_pass(r), dict(BLK=1024), {}),
            ("ssd_chunk_scan_tma", render_fwd.render_chunk_scan(r, 1, "forward", True), SCAN, SCAN_DESCRIPTORS),
            ("ssd_chunk_scan_tma:square", render_fwd.render_chunk_scan(r, 1, "forward", True), dict(SCAN, BK=64),
             dict(SCAN_DESCRIPTORS, xd=(64, 64), cbd=(64, 64))),
            ("ssd_gate_backward_tma", render_fwd.render_chunk_scan(r, 1, "gate_backward", True), SCAN,
             {k: v for k, v in SCAN_DESCRIPTORS.items() if k != "yd"}),
            ("ssd_chunk_dstate_tma", render_fwd.render_chunk_state(r, "dstate", 1, True),
             dict(BT=32, BP=64, NP=128), {"dyd": (32, 64), "cd": (32, 128)}),
            ("ssd_state_walk_bwd", render_state_walk.render_state_walk_bwd(r),
             dict(BT=32, BP=32, BN=64, P=64, N=128), {"dyd": (32, 32), "cd": (32, 64)}),
            ("ssd_dx_tma", render_bwd_tiles.render_dx(r, 1, True), SCAN, DX_DESCRIPTORS),
            ("ssd_dcb_tma", render_bwd_pairs.render_dcb(r, 1, True), dict(BT=64, PP=64, EVEN=True),
             {"xd": (64, 64), "dyd": (64, 64), "cbd": (64, 64)}),
            ("ssd_dc_tma", render_bwd_tiles.render_dbc(r, "c", True), tiles, DC_DESCRIPTORS),
            ("ssd_db_tma", render_bwd_tiles.render_dbc(r, "b", True), tiles, DB_DESCRIPTORS)]
    small = dict(Q=256, BLOCK=1024, CB=4, WP=4, EMULATE_BF16=False)
    out += [("cp_incoming", cp_combine_kernels._incoming, dict(small, HAS_FINAL=True), {}, SMALL),
            ("cp_incoming_without_final", cp_combine_kernels._incoming, dict(small, HAS_FINAL=False), {}, SMALL),
            ("cp_outgoing", cp_combine_kernels._outgoing, small, {}, SMALL)]
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter's kernels do not compile")
    failed = 0
    for name, kernel, constexprs, descriptors, *pointers in cases():
        if isinstance(kernel, str):
            kernel = _kernel(name.split(":")[0].removesuffix("_tma"), kernel)
        signature = {a: _type(a, constexprs, descriptors, pointers[0] if pointers else {}) for a in kernel.arg_names}
        try:
            triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))
            print(f"compiled {name}", flush=True)
        except Exception as exc:   # report every kernel, then fail
            failed += 1
            print(f"failed {name}: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
