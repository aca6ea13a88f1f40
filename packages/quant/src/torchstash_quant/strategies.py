"""The ``quant.*`` strategies, registered through the core's one registration path."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .auto import AutoQuantizer
from .fp8 import Fp8Quantizer
from .groupwise import GroupQuantizer
from .mesa.codec import MesaQuantizer
from .opaware import OpAware

if TYPE_CHECKING:
    from torchstash.registry import Registry


def quant(
    bits: int = 8,
    group_size: int = 256,
    stochastic: bool = True,
    seed: int | None = None,
    norm_bits: int | str | None = "auto",
) -> OpAware:
    """Per-group quantization at ``bits`` (1, 2, 4 or 8), plus exact 1-bit ReLU and mask codes;
    inputs of normalization ops at ``norm_bits`` (``"auto"``: 8 when ``bits`` is 4, 4 below;
    None: at ``bits`` like everything else)."""
    name = f"quant.int{bits}"
    values = GroupQuantizer(bits, group_size, stochastic, seed, name=name)
    if norm_bits == "auto":
        norm_bits = {8: None, 4: 8}.get(bits, 4)
    elif norm_bits is not None and not isinstance(norm_bits, int):
        from torchstash.errors import OptionError

        raise OptionError(
            f"{name}: option norm_bits={norm_bits!r} must be 1, 2, 4, 8, 'auto' or None"
        )
    norms = None
    if norm_bits is not None and norm_bits != bits:
        norms = GroupQuantizer(norm_bits, group_size, stochastic, seed, name=name)
    return OpAware(values, norms)


def _fixed(bits: int) -> object:
    def factory(
        group_size: int = 256,
        stochastic: bool = True,
        seed: int | None = None,
        norm_bits: int | str | None = "auto",
    ) -> OpAware:
        return quant(bits, group_size, stochastic, seed, norm_bits)

    factory.__name__ = f"int{bits}"
    return factory


def mesa(
    bits: int = 8,
    ema_decay: float = 0.9,
    groups: int | None = None,
    stochastic: bool = True,
    seed: int | None = None,
    group_size: int | None = None,
) -> OpAware:
    return OpAware(MesaQuantizer(bits, ema_decay, groups, stochastic, seed, group_size))


def auto(
    budget: float = 2.0,
    bits: tuple[int, ...] = (1, 2, 4, 8),
    group_size: int = 256,
    interval: int = 20,
    stochastic: bool = True,
    seed: int | None = None,
) -> OpAware:
    """Mixed precision: ``budget`` average bits, re-allocated every ``interval`` steps."""
    return OpAware(AutoQuantizer(budget, bits, group_size, interval, stochastic, seed))


def fp8(group_size: int = 256) -> OpAware:
    return OpAware(Fp8Quantizer(group_size))


def register(registry: Registry) -> None:
    registry.register(
        "quant",
        quant,
        lossless=False,
        summary="per-group stochastic quantization at bits=1/2/4/8 (default 8)",
        preset=True,
    )
    for bits in (8, 4, 2, 1):
        registry.register(
            f"quant.int{bits}",
            _fixed(bits),  # type: ignore[arg-type]
            lossless=False,
            summary=f"{bits}-bit per-group stochastic quantization (ActNN/GACT scheme, fused)",
        )
    registry.register(
        "quant.mesa",
        mesa,
        lossless=False,
        summary="Mesa: 8-bit head-wise with running (EMA) range estimates, clamped",
    )
    registry.register(
        "quant.auto",
        auto,
        lossless=False,
        summary="mixed 1/2/4/8-bit under an average budget (default 2), from range x gradient",
    )
    from .levels import LEVELS, SUMMARIES, _factory

    for name in LEVELS:
        registry.register(
            f"quant.{name}",
            _factory(name),  # type: ignore[arg-type]
            lossless=name == "L0",
            summary=SUMMARIES[name],
            preset=True,
        )
    registry.register(
        "quant.fp8",
        fp8,
        lossless=False,
        summary="e4m3 float codes with a per-group scale",
    )
