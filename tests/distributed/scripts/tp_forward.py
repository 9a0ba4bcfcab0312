"""Launched by ``mambac run -n 2``: compile a tiny LM for tp=2, compare with eager, write a file."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository (for tests.*)

import torch  # noqa: E402

import mambac  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.models.tiny import tiny_lm  # noqa: E402

model = tiny_lm("mamba2", n_layer=1)
compiled = mambac.compile(model, world_size=2, comm_timeout=60)
ids = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0))
err = rel_err(compiled(ids), model(ids))
rank = torch.distributed.get_rank()
with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
    f.write(("ok " if err <= 1e-5 else "bad ") + str(err))
