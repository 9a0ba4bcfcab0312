"""Progress bars for long work: on with MAMBAC_PROGRESS=1, off with 0, on stderr only."""
import torch

import mambac
from mambac.knobs import override
from tests.models.tiny import tiny_lm


def _compile_with(progress: str, capsys) -> str:
    model = tiny_lm("mamba2", n_layer=1)
    ids = torch.randint(0, 37, (1, 8))
    with override(progress=progress):
        mambac.compile(model, example_inputs=(ids,))
    captured = capsys.readouterr()
    assert "lowering" not in captured.out          # never on stdout
    return captured.err


def test_lowering_shows_a_bar_when_asked(capsys):
    assert "mambac: lowering rank 0" in _compile_with("1", capsys)


def test_no_bar_when_off(capsys):
    assert "mambac: lowering" not in _compile_with("0", capsys)
