"""mambac: a compiler for Mamba-family sequence models.

Doors: ``mambac.compile(model, world_size=...)``, ``torch.compile(model, backend="mambac")`` and the
``mambac`` command line.  See README.md.
"""
from mambac import ops  # noqa: F401  (registers the custom ops)
from mambac.api import compile  # noqa: A001
from mambac.autoplan import plan  # noqa: F401  (the layout planner; the sharding plan lives in mambac.sharding_plan)
from mambac.capture import capture
from mambac.convert import from_pretrained  # noqa: F401
from mambac.errors import (MambacCaptureError, MambacConfigError, MambacError, MambacInputError,
                           MambacOptionsError, MambacPassError, MambacRuntimeError)
from mambac.options import CompileOptions
from mambac.training import clip_grad_norm_
from mambac.trainer import SyntheticTokens, Trainer, init_restartable_process_group  # noqa: F401

import os as _os

from mambac.logs import configure as _configure_logs

_configure_logs(_os.environ.get("MAMBAC_LOGS"))  # whichever door mambac is used through
__version__ = "0.1.0"
__all__ = ["compile", "plan", "capture", "from_pretrained", "CompileOptions", "MambacError", "MambacInputError", "MambacOptionsError",
           "MambacConfigError", "MambacCaptureError", "MambacPassError", "MambacRuntimeError", "clip_grad_norm_"]
