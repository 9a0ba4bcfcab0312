"""The converter registry: lookup by class, clear errors, user converters and the key round trip."""
import pytest
import torch
import torch.nn as nn

import mambac
from mambac.convert import (Conversion, convert, key_map, original_state_dict, register_converter,
                            supported_classes, unregister_converter)
from mambac.convert.registry import qualified_name
from mambac.errors import MambacConfigError, MambacInputError
from mambac.models import Mamba2
from tests.helpers import rel_err


class Foreign(nn.Module):
    """A mixer someone else wrote: a Mamba2 under other names (``core``), plus nothing else."""

    def __init__(self):
        super().__init__()
        self.core = Mamba2(16, d_state=8, headdim=8, chunk_size=4)

    def forward(self, x):
        return self.core(x)


def _foreign_converter(model: Foreign) -> Conversion:
    # the Mamba2 already is a mambac mixer: reuse it, so the tensors are shared; keys lose "core."
    return Conversion(model.core, {k: f"core.{k}" for k in model.core.state_dict()}, "tests.Foreign")


def test_unknown_class_lists_supported_classes_and_how_to_register():
    with pytest.raises(MambacInputError) as err:
        convert(Foreign())
    text = str(err.value)
    assert qualified_name(Foreign) in text and "register_converter" in text
    assert "transformers.models.mamba2.modeling_mamba2.Mamba2ForCausalLM" in text
    assert "mamba_ssm.models.mixer_seq_simple.MambaLMHeadModel" in text


def test_builtin_converters_are_registered_by_name():
    names = supported_classes()
    for cls in ("transformers.models.mamba.modeling_mamba.MambaForCausalLM",
                "transformers.models.mamba.modeling_mamba.MambaModel",
                "transformers.models.mamba2.modeling_mamba2.Mamba2ForCausalLM",
                "transformers.models.mamba2.modeling_mamba2.Mamba2Model",
                "mamba_ssm.models.mixer_seq_simple.MambaLMHeadModel", "mamba_ssm.modules.mamba_simple.Mamba",
                "mamba_ssm.modules.mamba2.Mamba2", "mamba_ssm.modules.mamba3.Mamba3"):
        assert cls in names


def test_user_converter_shares_tensors_round_trips_keys_and_compiles():
    register_converter(Foreign, _foreign_converter)
    try:
        model = Foreign()
        converted = convert(model)
        assert converted is model.core
        assert key_map(converted)["in_proj.weight"] == "core.in_proj.weight"
        sd = original_state_dict(converted)
        assert list(sd) == list(model.state_dict()) and all(sd[k].data_ptr() == v.data_ptr() for k, v in model.state_dict().items())
        x = torch.randn(2, 6, 16)
        assert rel_err(mambac.compile(model)(x), model(x)) <= 1e-5
    finally:
        unregister_converter(Foreign)
    with pytest.raises(MambacInputError, match="no converter"):
        convert(model)


def test_registration_rules():
    register_converter(qualified_name(Foreign), _foreign_converter)
    try:
        with pytest.raises(MambacInputError, match="already registered"):
            register_converter(Foreign, _foreign_converter)
        register_converter(Foreign, _foreign_converter, replace=True)
    finally:
        unregister_converter(Foreign)
    with pytest.raises(MambacInputError, match="qualified class name"):
        register_converter("Foreign", _foreign_converter)
    with pytest.raises(MambacInputError, match="callable"):
        register_converter(Foreign, "not a function")


def test_converter_with_a_wrong_key_map_is_caught():
    register_converter(Foreign, lambda m: Conversion(m.core, {}))
    try:
        with pytest.raises(MambacConfigError, match="maps to '.*', which the original Foreign does not have"):
            convert(Foreign())
    finally:
        unregister_converter(Foreign)


def test_mambac_models_pass_through_and_non_modules_are_refused():
    mixer = Mamba2(16, d_state=8, headdim=8)
    assert convert(mixer) is mixer
    assert key_map(mixer) == {k: k for k in mixer.state_dict()}
    with pytest.raises(MambacInputError, match="torch.nn.Module"):
        convert(object())
