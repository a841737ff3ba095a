"""`module.path:object.attribute` import paths, as the API's task, reward function and evaluator fields
name user code."""
from __future__ import annotations

import importlib
from typing import Any


class ImportPathError(ValueError):
    """An import path that is malformed, whose module does not import, or that names nothing there."""


def import_object(path: str) -> Any:
    """The object `path` names: `module:name`, or `module:Class.attribute` (each dotted part looked up in
    turn). Raises ImportPathError saying which part failed. Blocking: imports user code."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ImportPathError(f"must read module:object, got {path!r}")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportPathError(f"cannot import module {module_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(found, part):
            raise ImportPathError(f"{module_name!r} has no {attr!r}")
        found = getattr(found, part)
    return found
