"""mambac's exception types.

Every error mambac raises on purpose is a ``MambacError``: it says what is wrong and what to do.
They subclass the builtin exception a user would otherwise expect (ValueError, TypeError,
RuntimeError) so existing ``except`` clauses keep working.
"""
from __future__ import annotations


class MambacError(Exception):
    """Base class of every error mambac raises on purpose."""


class MambacInputError(MambacError, ValueError):
    """A tensor, shape, dtype or argument given to mambac is not acceptable."""


class MambacOptionsError(MambacError, ValueError):
    """Unknown, contradictory or unsupported compile options."""


class MambacConfigError(MambacError, ValueError):
    """A model configuration that mambac (or the model itself) cannot honour."""


class MambacCaptureError(MambacError, RuntimeError):
    """A model could not be captured into a graph."""


class MambacPassError(MambacError, RuntimeError):
    """A pass failed or produced an invalid graph."""


class MambacRuntimeError(MambacError, RuntimeError):
    """The compiled module cannot run in the current environment."""
