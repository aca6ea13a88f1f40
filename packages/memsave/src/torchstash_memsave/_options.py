"""Validation of the memsave strategy's and drop-in's options; every error names the option."""

from __future__ import annotations

from torchstash.errors import OptionError


def check_flag(value: object, name: str, strategy: str) -> bool:
    """A layer-family switch: True or False, nothing else (a 0 or a "no" is a typo)."""
    if not isinstance(value, bool):
        raise OptionError(f"{strategy}: option {name}={value!r} must be True or False")
    return value
