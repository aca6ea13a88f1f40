"""Validation of the options every quant strategy shares; errors name the option."""

from __future__ import annotations

from collections.abc import Iterable

from torchstash.errors import OptionError

BITS = (1, 2, 4, 8)


def check_bits(bits: object, strategy: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise OptionError(
            f"{strategy}: option bits={bits!r} is not supported; use one of 1, 2, 4, 8"
        )
    return bits


def check_group_size(group_size: object, strategy: str) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise OptionError(
            f"{strategy}: option group_size={group_size!r} must be a positive integer "
            f"(elements per group sharing one min and scale; default 256)"
        )
    return group_size


def check_fraction(value: object, name: str, strategy: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise OptionError(f"{strategy}: option {name}={value!r} must be a number in [0, 1)")
    return float(value)


DERIV_BITS = (2, 4, 8)


def check_deriv_bits(value: object, strategy: str, default: int | None) -> int | None:
    """``deriv_bits``: width of GELU/SiLU derivative codes; ``"auto"`` gives ``default``,
    None keeps their inputs as values."""
    if value == "auto":
        return default
    return _width(value, strategy, "deriv_bits", DERIV_BITS, "GELU/SiLU inputs as values", True)


def check_attn_bits(value: object, strategy: str, option: str = "attn_bits") -> int | None:
    """``attn_bits``: width of attention's values (``v``, a map after a dropout that drops);
    None keeps them at the strategy's own width."""
    return _width(value, strategy, option, BITS, "them at the strategy's width", False)


def _width(
    value: object, strategy: str, option: str, allowed: Iterable[int], none: str, auto: bool
) -> int | None:
    """``value`` when it is one of ``allowed`` widths (or None); else an error that lists
    them (with ``'auto'`` where it is taken) and says what None stores."""
    widths = sorted(allowed)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in widths:
        listed = ", ".join([*map(str, widths), *(["'auto'"] if auto else [])])
        raise OptionError(
            f"{strategy}: option {option}={value!r} must be {listed} or None (None stores {none})"
        )
    return value
