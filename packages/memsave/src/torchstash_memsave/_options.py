"""Validation of the memsave strategy's and drop-in's options; every error names the option."""

from __future__ import annotations

from torchstash.errors import OptionError


def check_flag(value: object, name: str, strategy: str) -> bool:
    """A layer-family switch: True or False, nothing else (a 0 or a "no" is a typo)."""
    if not isinstance(value, bool):
        raise OptionError(f"{strategy}: option {name}={value!r} must be True or False")
    return value


def check_flags(flags: dict[str, object], strategy: str) -> dict[str, bool]:
    """Every switch of ``flags`` checked (:func:`check_flag`), by name."""
    return {name: check_flag(value, name, strategy) for name, value in flags.items()}
