import pytest
import torch

import mambac
from mambac.errors import MambacPassError
from mambac.ir import VAL
from mambac.knobs import knobs, override, reload
from mambac.options import CompileOptions
from mambac.passes.context import PassContext
from mambac.passes.runner import run_passes
from tests.models.tiny import tiny_lm


def test_dump_dir_gets_every_pass(tmp_path):
    compiled = mambac.compile(tiny_lm("mamba1"), dump_dir=str(tmp_path))
    files = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    assert files == ["00_capture.txt", "01_canonicalize.txt", "02_fuse_ssm.txt", "03_fuse_loss.txt",
                     "04_eliminate_dead_code.txt"]
    assert (tmp_path / "rank0" / "02_fuse_ssm.txt").read_text().startswith("# mambac graph after 'fuse_ssm'")
    ctx = next(iter(compiled.programs.values())).ctx
    assert set(ctx.timings) == {"canonicalize", "fuse_ssm", "fuse_loss", "eliminate_dead_code"}
    assert [n for n, _ in ctx.history] == ["capture", "canonicalize", "fuse_ssm", "fuse_loss",
                                           "eliminate_dead_code"]


def test_disable_passes_knob(monkeypatch):
    monkeypatch.setenv("MAMBAC_DISABLE_PASSES", "fuse_ssm,fuse_loss,eliminate_dead_code")
    reload()
    try:
        compiled = mambac.compile(tiny_lm("mamba2"))
        ctx = next(iter(compiled.programs.values())).ctx
        assert set(ctx.timings) == {"canonicalize"}
    finally:
        monkeypatch.delenv("MAMBAC_DISABLE_PASSES")
        reload()


def test_verifier_catches_a_node_without_shape():
    model = tiny_lm("mamba2")
    gm = mambac.capture(model, model.example_inputs())
    victim = next(n for n in gm.graph.nodes if n.op == "call_function")
    del victim.meta[VAL]
    with pytest.raises(MambacPassError, match=f"node '{victim.name}'.*no shape"):
        run_passes(gm, PassContext(options=CompileOptions.create(), verify=True), ["canonicalize"])


def test_unknown_pass_name():
    model = tiny_lm("mamba2")
    gm = mambac.capture(model, model.example_inputs())
    with pytest.raises(MambacPassError, match="unknown passes"):
        run_passes(gm, PassContext(), ["fuse_everything"])


def test_override_restores():
    before = knobs().verify
    with override(verify=not before):
        assert knobs().verify is (not before)
    assert knobs().verify is before
