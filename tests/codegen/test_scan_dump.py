"""``mambac dump MODEL --kernels`` lists the generated scan kernels of Mamba-1 and Mamba-3 models,
specialised to the flags the blocks call the ops with.  Nothing is launched."""
from __future__ import annotations

import ast

from mambac.cli import main
from tests.helpers import assert_in_order


def _kernels(capsys, preset: str) -> str:
    assert main(["dump", preset, "--kernels", "--seqlen", "8"]) == 0
    out = capsys.readouterr().out
    for chunk in out.split("# ===== ")[1:]:
        ast.parse(chunk.split("\n", 1)[1])
    return out


def test_dump_lists_the_selective_scan_kernels(capsys):
    out = _kernels(capsys, "mamba1-tiny")
    assert_in_order(out, "# ===== selective_scan_chunk_local-", "flags=[delta_bias,softplus,D,z]",
                    "# ===== selective_scan_combine-", "# ===== selective_scan_chunk_out-", "y = y * silu",
                    "# ===== selective_scan_adjoint_local-", "# ===== selective_scan_adjoint_combine-",
                    "# ===== selective_scan_bwd-")
    assert "ops without generated kernels" not in out


def test_dump_lists_the_mamba3_kernels(capsys):
    out = _kernels(capsys, "mamba3-tiny")
    assert_in_order(out, "# ===== mamba3_siso_fwd-", "(checkpoints)", "# ===== mamba3_siso_bwd-")
    assert "ops without generated kernels" not in out
