"""Upstream constructors' argument lists, bound as Python binds a signature: for the drop-in
layers, whose ``__init__`` takes the torch layer's arguments and the project's own in the
upstream order, positionally or by name."""

from __future__ import annotations

from typing import Any


def bind(
    owner: str, order: tuple[str, ...], positional: tuple[Any, ...], named: dict[str, Any]
) -> dict[str, Any]:
    """``named`` with ``positional`` added under the names of ``order``; the errors Python gives
    for too many positional arguments or one given twice, naming ``owner``."""
    if len(positional) > len(order):
        raise TypeError(
            f"{owner}() takes at most {len(order)} positional arguments "
            f"({', '.join(order)}), got {len(positional)}"
        )
    for name, value in zip(order, positional, strict=False):
        if name in named:
            raise TypeError(f"{owner}() got multiple values for argument {name!r}")
        named[name] = value
    return named
