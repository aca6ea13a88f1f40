"""Validation of the options every quant strategy shares; errors name the option."""

from __future__ import annotations

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
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in DERIV_BITS:
        raise OptionError(
            f"{strategy}: option deriv_bits={value!r} must be 2, 4, 8, 'auto' or None "
            f"(None stores GELU/SiLU inputs as values)"
        )
    return value


def check_attn_bits(value: object, strategy: str, option: str = "attn_bits") -> int | None:
    """``attn_bits``: width of attention's values (``v``, a map after a dropout that drops);
    None keeps them at the strategy's own width."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in BITS:
        raise OptionError(
            f"{strategy}: option {option}={value!r} must be 1, 2, 4, 8 or None "
            f"(None stores them at the strategy's width)"
        )
    return value
