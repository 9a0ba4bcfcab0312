import pytest
import torch
import torch.nn as nn

import mambac
from mambac.errors import MambacCaptureError
from mambac.ir import SOURCE, VAL
from tests.models.tiny import tiny_lm


def test_each_ssm_op_is_one_node_with_shapes():
    model = tiny_lm("mamba2")
    gm = mambac.capture(model, model.example_inputs(2, 12))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("mambac.ssd") == 2 and targets.count("mambac.causal_conv1d") == 2
    for node in gm.graph.nodes:
        if node.op != "output":
            assert VAL in node.meta, node.name
    ssd = next(n for n in gm.graph.nodes if str(n.target) == "mambac.ssd")
    assert tuple(ssd.meta[VAL][0].shape) == (2, 12, 8, 8)
    assert ssd.meta[SOURCE].module_path == "backbone.layers.0.mixer"


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


class Inner(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


def test_control_flow_on_tensor_values_is_a_clear_error():
    with pytest.raises(MambacCaptureError) as info:
        mambac.capture(DataDependent(), (torch.randn(3),))
    msg = str(info.value)
    assert "module 'inner' (Inner)" in msg and "control flow" in msg and "To fix" in msg


def test_missing_example_inputs_is_a_clear_error():
    with pytest.raises(MambacCaptureError, match="example_inputs"):
        mambac.capture(nn.Linear(2, 2))


def test_wrong_example_shapes_name_the_module():
    model = tiny_lm("mamba2")
    with pytest.raises(MambacCaptureError, match="shape propagation failed"):
        mambac.capture(model, (torch.randint(0, 5, (2, 3, 4)),))
