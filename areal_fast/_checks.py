"""Range checks shared by the config dataclasses (each raises one ValueError naming the key)."""

from __future__ import annotations

import math


def at_least(name: str, value: int, low: int, why: str = "") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value >= low`` (``why`` is appended)."""
    if value < low:
        raise ValueError(f"{name} = {value} must be >= {low} {why}".rstrip())


def positive_finite(name: str, value: float) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number > 0."""
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} = {value} must be a finite number > 0")
