"""GACT's ``config``, ``set_optimization_level`` and ``set_adapt_interval``.

Fields and defaults are GACT's. What they mean here: ``compress_activation`` (off: nothing
quantized), ``bit`` (the width, or with ``auto_prec`` the average budget of ``quant.auto``),
``swap`` (payloads to host memory), ``adapt_interval`` (steps between ``quant.auto``'s
allocations), ``group_size``. The others (``check_dup``: every saved tensor is deduplicated
by storage here; ``max_bit``, ``prefetch``, ``work_dir``, ``log_interval``, ``debug``) are
accepted and change nothing. Each ``set_optimization_level`` starts from the defaults (GACT
changed only the level's own fields).
"""

from __future__ import annotations

from typing import Any

from torchstash.errors import OptionError

LEVELS = ("L0", "L1", "L1.1", "L1.2", "L2", "L2.1", "L2.2", "L3", "swap", "L4bit-swap")


class QuantizationConfig:
    def __init__(self) -> None:
        self.level = "L2"
        self.compress_activation = True
        self.bit = 4
        self.group_size = 256
        self.check_dup = False
        self.auto_prec = True
        self.max_bit = 32
        self.adapt_interval = 1000
        self.work_dir = "./log/"
        self.log_interval = -1
        self.debug = False
        self.swap = False
        self.prefetch = False


config = QuantizationConfig()


def set_optimization_level(level: str) -> None:
    """GACT's levels: L0 (nothing), L1/L1.1/L1.2 (4/8/2 bits), L2/L2.1/L2.2 (4/3/2 bits on
    average, mixed), L3 (L2 swapped to host memory), ``swap`` (swapped, not quantized),
    ``L4bit-swap`` (4 bits, swapped)."""
    if level not in LEVELS:
        raise OptionError(f"unknown GACT level {level!r}; use one of {', '.join(LEVELS)}")
    interval = config.adapt_interval
    config.__init__()  # type: ignore[misc]
    config.level, config.adapt_interval = level, interval
    fixed = {"L1": 4, "L1.1": 8, "L1.2": 2, "L4bit-swap": 4}
    adaptive = {"L2": 4, "L2.1": 3, "L2.2": 2, "L3": 4}
    if level == "L0":
        config.compress_activation = False
    elif level in fixed:
        config.auto_prec, config.bit = False, fixed[level]
    elif level in adaptive:
        config.auto_prec, config.bit = True, adaptive[level]
    if level in ("L3", "swap", "L4bit-swap"):
        config.swap = config.prefetch = True
    if level == "swap":
        config.compress_activation = False


def set_adapt_interval(i: int) -> None:
    config.adapt_interval = i


def strategy() -> tuple[str | None, dict[str, Any]]:
    """(strategy, options) for the current ``config``; None where nothing is to be done."""
    if not config.compress_activation:
        return ("offload.cpu", {}) if config.swap else (None, {})
    options: dict[str, Any] = {"group_size": config.group_size}
    if config.auto_prec:
        interval = config.adapt_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise OptionError(f"config.adapt_interval={interval!r} must be a positive integer")
        name = "quant.auto"
        # GACT measures every adapt_interval steps, however still the allocation
        options.update(budget=config.bit, interval=interval, max_interval=interval)
    elif config.bit in (1, 2, 4, 8):
        name = f"quant.int{config.bit}"
    else:
        raise OptionError(f"config.bit={config.bit!r}: a fixed width is 1, 2, 4 or 8 bits")
    if config.swap:
        return f"{name}>offload.cpu", {name: options}
    return name, options
