"""Validation of the dropit strategies' options; every error names the option."""

from __future__ import annotations

from torchstash.errors import OptionError

SCOPES = ("tensor", "sample", "row", "feature")
STORAGES = ("auto", "bitmap", "offsets")
KEEPS = ("ceil", "floor")
DENSES = ("exact", "drop")
INDICES = ("device", "cpu")
FILLS = ("mean", "zero")


def check_gamma(value: object, strategy: str, name: str = "gamma") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise OptionError(
            f"{strategy}: option {name}={value!r} must be a number in [0, 1) (the share of "
            f"values dropped; 0 drops nothing)"
        )
    return float(value)


def check_choice(value: object, name: str, choices: tuple[str, ...], strategy: str) -> str:
    if value not in choices:
        raise OptionError(
            f"{strategy}: option {name}={value!r} must be one of {', '.join(map(repr, choices))}"
        )
    return str(value)


def check_min_numel(value: object, strategy: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise OptionError(
            f"{strategy}: option min_numel={value!r} must be a positive integer (smaller "
            f"tensors are stored as they are)"
        )
    return value
