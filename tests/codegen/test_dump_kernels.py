"""``mambac dump MODEL --kernels``: the generated source of every kernel the lowered program uses,
specialised to each op's flags, printed or written to a directory.  Nothing is launched."""
from __future__ import annotations

import ast

from mambac.cli import main
from tests.helpers import assert_in_order


def test_dump_kernels_prints_every_kernel_of_the_program(capsys):
    assert main(["dump", "mamba2-tiny", "--kernels", "--seqlen", "8"]) == 0
    out = capsys.readouterr().out
    # block order of the program: add_rmsnorm (no residual yet), conv, ssd forward then backward, gated norm
    assert_in_order(out, "# ===== add_rmsnorm_fwd-", "flags=[]", "def add_rmsnorm_fwd(x_ptr, w_ptr,",
                    "# ===== causal_conv1d_fwd-", "width=4 flags=[bias,silu]", "acc = acc * tl.sigmoid(acc)",
                    "# ===== ssd_chunk_state-", "flags=[dt_bias,softplus]", "def _dt_transform(d, bias):",
                    "# ===== ssd_chunk_scan-", "# ===== ssd_dt_backward-",
                    "# ===== gated_rmsnorm_fwd-", "gate=before_norm", "h = xv * sz",
                    "# ===== add_rmsnorm_fwd-", "flags=[residual]", "+ tl.load(res_ptr")
    # the mixer has no z on the SSD (the gate is in the norm): no gate-backward kernel
    assert "ssd_gate_backward" not in out
    # each kernel once, even though both layers use it
    assert out.count("# ===== causal_conv1d_fwd-") == 1 and "nodes causal_conv1d, causal_conv1d_1" in out
    for chunk in out.split("# ===== ")[1:]:
        ast.parse(chunk.split("\n", 1)[1])


def test_dump_kernels_to_a_directory(tmp_path, capsys):
    d = tmp_path / "kernels"
    assert main(["dump", "mamba1-tiny", "--kernels", "--seqlen", "8", "-o", str(d)]) == 0
    assert "kernel sources and index.txt" in capsys.readouterr().out
    index = (d / "index.txt").read_text()
    files = sorted(p.name for p in d.glob("*.py"))
    assert files and all(name in index for name in files)
    assert any(n.startswith("causal_conv1d_bwd-") for n in files)
    for p in d.glob("*.py"):
        ast.parse(p.read_text())
