"""Names dynamo gives modules, as mambac uses them: dotted module paths and qualified class names.

Dynamo records the modules around each traced node in ``node.meta["nn_module_stack"]`` as
(``L['self'].layers[0].mixer``, class) pairs; the backend matches regions and parameters by the
dotted path (``layers.0.mixer``) and the class's qualified name.
"""
from __future__ import annotations

import re
from typing import Any


def dotted(path: str) -> str:
    """Dynamo's module path (``L['self'].layers[0].mixer``) as a dotted name (``layers.0.mixer``),
    without the ``__dict__['_modules']`` steps some paths take."""
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)
    # some sources reach a child through the module's internals: L['self'].__dict__['_modules']['mix'][0]
    return ".".join(part for part in path.split(".") if part and part not in ("__dict__", "_modules"))


def qualname(cls: Any) -> str:
    """``module.QualName`` of a class (a string is taken as already qualified)."""
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
