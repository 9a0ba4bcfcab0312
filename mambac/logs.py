"""``MAMBAC_LOGS``: the level of the ``mambac`` logger, set when mambac is imported.

Every part of mambac logs through ``logging.getLogger("mambac.<part>")`` (``mambac.passes``,
``mambac.codegen``, ``mambac.plan``, ...).  With ``MAMBAC_LOGS=info`` (or ``debug``, ``warning``, a
number) the ``mambac`` logger gets that level and one stream handler on standard error, whichever
door is used: ``import mambac``, ``torch.compile(backend="mambac")`` or the CLI.  Unset, nothing is
configured and the application's own logging setup decides.
"""
from __future__ import annotations

import logging

from mambac.errors import MambacOptionsError

_LEVELS = ("debug", "info", "warning", "error", "critical")
_HANDLER_NAME = "mambac-logs"


def parse_level(text: str) -> int:
    """``"info"`` / ``"DEBUG"`` / ``"20"`` -> a logging level; anything else is a clear error."""
    t = text.strip().lower()
    if t.isdigit():
        return int(t)
    if t in _LEVELS:
        return getattr(logging, t.upper())
    raise MambacOptionsError(f"MAMBAC_LOGS={text!r} is not a logging level; use one of {', '.join(_LEVELS)} "
                             "or a number (e.g. MAMBAC_LOGS=info), or unset it.")


def configure(level_text: str | None) -> None:
    """Give the ``mambac`` logger ``level_text``'s level and one stderr handler (once)."""
    if not level_text:
        return
    level = parse_level(level_text)
    logger = logging.getLogger("mambac")
    logger.setLevel(level)
    if not any(h.get_name() == _HANDLER_NAME for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.set_name(_HANDLER_NAME)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
