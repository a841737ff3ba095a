"""The run's spec as flat tracker params: `trainer.learningRate` -> "0.001" (pure)."""
from __future__ import annotations

from typing import Any


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts and lists as dotted keys (list items by index); None is left out."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list):
        if not value:
            out[prefix] = "[]"
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}.{i}"))
    elif value is not None:
        out[prefix] = str(value).lower() if isinstance(value, bool) else str(value)
    return out
