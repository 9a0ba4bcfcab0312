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


def _dispatcher_probe(x):
    """Records whether the Python dispatcher is on while a fake-tensor run reaches this node."""
    _dispatcher_probe.seen.append(torch._C._dispatch_tls_local_include_set().has(torch._C.DispatchKey.PythonDispatcher))
    return x


def test_symbolic_propagation_runs_under_the_python_dispatcher():
    """With symbolic sizes (the backend's case) shapes are propagated, and values of new nodes
    computed, under the Python dispatcher, as dynamo traces: without it torch 2.11's C++ matmul
    behind F.linear asks the fake input for concrete sizes and pins the length (measured there:
    every new length compiled again).  A static propagation is left as it was.  The length stays
    a symbol through the linear."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    from mambac.capture import fake_mode, propagate_shapes
    from mambac.passes.rewrite import refresh

    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    probe = graph.call_function(_dispatcher_probe, (x,))
    graph.output(graph.call_function(F.linear, (probe, w)))
    weight = torch.randn(6, 4)
    for symbolic in (True, False):
        gm = torch.fx.GraphModule({}, graph)
        _dispatcher_probe.seen = []
        if symbolic:
            mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
            dims = [DimDynamic.STATIC, DimDynamic.DYNAMIC, DimDynamic.STATIC]
            xs = mode.from_tensor(torch.randn(2, 24, 4), symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))
        else:
            mode, xs = fake_mode(), torch.randn(2, 24, 4)
        propagate_shapes(gm, [xs, weight], mode)
        refresh(next(n for n in gm.graph.nodes if n.target is _dispatcher_probe))
        assert _dispatcher_probe.seen == [symbolic, symbolic]
        out = next(n for n in gm.graph.nodes if n.op == "output").args[0].meta[VAL]
        assert tuple(out.shape[::2]) == (2, 6)
        if symbolic:   # the length's symbol is not replaced by a number (the weight's sizes are)
            assert isinstance(out.shape[1], torch.SymInt)
            assert out.shape[1].node.expr in xs.shape[1].node.expr.free_symbols
            assert out.shape[1].node.expr not in mode.shape_env.replacements
        else:
            assert out.shape[1] == 24
