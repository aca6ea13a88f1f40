"""The ``quant.*`` strategies, registered through the core's one registration path."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchstash.compressor import Composed, Compressor
from torchstash.declare import StrategyTable, configured
from torchstash.errors import OptionError
from torchstash.offload import CpuOffload
from torchstash.registry import AS_IS

from ._options import BITS, check_attn_bits, check_bits, check_deriv_bits, check_group_size
from .auto import UNRANKED_BITS, AutoQuantizer
from .derivs import DerivCoder
from .fp8 import Fp8Quantizer
from .groupwise import GroupQuantizer
from .levels import LEVELS, SUMMARIES, OnlyOps
from .mesa_codec import MesaQuantizer
from .mesa_format import parse_mesa
from .opaware import OpAware

if TYPE_CHECKING:
    from torchstash.registry import Registry

STRATEGIES = StrategyTable()


#: ``deriv_bits="auto"`` per width: where derivative codes helped in the demo's training. At 2
#: bits they took the final loss from +6.8% over stock to +6.0-6.2%; at 4 bits, though closer
#: to f' per element, they cost +0.9% (+1.3-1.5% against +0.6%), rounded either way.
DERIV_DEFAULT: dict[int, int | None] = {1: 2, 2: 2, 4: None, 8: None}

#: ``act_bits="auto"`` per width: GELU/SiLU inputs as values (not derivative codes), so the
#: engine recomputes their outputs (the next Linear's input) from them at no cost of its own.
#: At 4 bits, at 8: the bench zoo's gradient cosine went from 0.9905 to 0.9998 (GPT) in about
#: the same bytes. At 2 bits, at 4: with attention's output recomputed too, cosine 0.99 (GPT,
#: ViT) at 12.4x, against 0.93/0.88 at 14.9x with 2-bit GELU inputs (see the README).
ACT_DEFAULT: dict[int, int | None] = {1: None, 2: 4, 4: 8, 8: None}

#: ``attn_bits="auto"`` per width: attention's values (``v``, and a map after a dropout that
#: drops) at 4 bits under ``quant.int2``. With LayerNorm outputs recomputed from 4-bit inputs,
#: attention at 4 bits took the demo's final loss from +5.4% over stock to +2.2%, at 14x
#: (attention decides training at 2 bits; the one-step cosine barely sees it). The map itself
#: is recomputed from ``q`` and ``k``, which are kept at 8 bits whatever the width
#: (:data:`~.opaware.SCORES_BITS`).
ATTN_DEFAULT: dict[int, int | None] = {1: None, 2: 4, 4: None, 8: None}


#: ``norm_bits="auto"`` per width: normalization inputs at 8 bits under 2 and 4, at 4 under 1.
#: A LayerNorm's input stands in for its output (``derive``), which every projection after it
#: reads for its weight gradient. At 4 bits under ``quant.int2`` it carried the error at
#: trained weights (a trained GPT's residual stream: the restored normalized rows 15-28% off,
#: ``k``'s weight-gradient cosine 0.64-0.95; at 8 bits 1-2% off, 0.94-0.99), and at a
#: constant learning rate int2 ended +3.3%, +2.9% and +3.1% above stock (three seeds of
#: ``scripts/convergence.py --schedule constant --steps 200 --models gpt-manual``); at 8 bits
#: +1.4%, +1.7% and +2.1%, at 10.5x instead of 12.6x on that GPT.
NORM_DEFAULT: dict[int, int | None] = {1: 4, 2: 8, 4: 8, 8: None}

#: ``quant.auto``'s start widths of normalization inputs (before its first allocation): 4
#: bits below a budget of 4, as int2's were; from its first allocation the budget decides.
AUTO_START_NORM: dict[int, int | None] = {1: 4, 2: 4, 4: 8, 8: None}


@dataclass(frozen=True)
class QuantConfig:
    """Per-group stochastic quantization at bits=1/2/4/8 (default 8).

    Per-group quantization at ``bits`` (1, 2, 4 or 8), plus exact 1-bit ReLU and mask codes;
    inputs of normalization ops at ``norm_bits`` (``"auto"``: 8 when ``bits`` is 2 or 4, 4 at 1;
    None: at ``bits`` like everything else); GELU/SiLU inputs as derivative codes of
    ``deriv_bits`` (``"auto"``: 2 bits below 4, else their values; see :data:`DERIV_DEFAULT`);
    attention's values (``v``) at ``attn_bits`` (``"auto"``: see :data:`ATTN_DEFAULT`; None:
    at ``bits``; its map is recomputed from ``q`` and ``k``, kept at 8 bits);
    GELU/SiLU inputs as values at ``act_bits`` (``"auto"``: see :data:`ACT_DEFAULT`; None:
    derivative codes or values as above). With ``derive``, LayerNorm inputs (at ``norm_bits``)
    and GELU/SiLU inputs stored as values stand in for the ops' outputs: the next op's saved
    input is recomputed from them (:mod:`torchstash.derive`).
    """

    bits: int = 8
    group_size: int = 256
    stochastic: bool = True
    seed: int | None = None
    norm_bits: int | str | None = "auto"
    deriv_bits: int | str | None = "auto"
    attn_bits: int | str | None = "auto"
    act_bits: int | str | None = "auto"
    derive: bool = True

    def __post_init__(self) -> None:
        """A config is valid once made: each option checked, its error naming it."""
        name = self.name
        check_bits(self.bits, name)
        check_group_size(self.group_size, name)
        for flag in ("stochastic", "derive"):
            if not isinstance(getattr(self, flag), bool):
                raise OptionError(
                    f"{name}: option {flag}={getattr(self, flag)!r} must be True or False"
                )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise OptionError(f"{name}: option seed={self.seed!r} must be an integer or None")
        norm = self.norm_bits
        if norm not in ("auto", None) and (
            isinstance(norm, bool) or not isinstance(norm, int) or norm not in BITS
        ):
            raise OptionError(
                f"{name}: option norm_bits={norm!r} must be 1, 2, 4, 8, 'auto' or None"
            )
        check_deriv_bits(self.deriv_bits, name, None)
        for option in ("attn_bits", "act_bits"):
            value = getattr(self, option)
            if value != "auto":
                check_attn_bits(value, name, option)

    @property
    def name(self) -> str:
        return f"quant.int{self.bits}"

    def resolved(self, option: str, defaults: dict[int, int | None]) -> int | None:
        """An option's width, ``"auto"`` read from ``defaults`` at this config's ``bits``."""
        value = getattr(self, option)
        return defaults.get(self.bits) if value == "auto" else value


def build_quant(config: QuantConfig) -> OpAware:
    """:class:`QuantConfig`'s handler: the value codec and its op-aware placement."""
    name = config.name
    bits, group_size, stochastic, seed = (
        config.bits,
        config.group_size,
        config.stochastic,
        config.seed,
    )
    values = GroupQuantizer(bits, group_size, stochastic, seed, name=name)
    width = check_deriv_bits(config.deriv_bits, name, DERIV_DEFAULT.get(bits))
    derivs = None if width is None else DerivCoder(width, stochastic, seed)
    norm_bits = config.resolved("norm_bits", NORM_DEFAULT)
    norms = None
    if norm_bits is not None and norm_bits != bits:
        norms = GroupQuantizer(norm_bits, group_size, stochastic, seed, name=name)
    return OpAware(
        values,
        norms,
        derivs,
        config.resolved("attn_bits", ATTN_DEFAULT),
        config.resolved("act_bits", ACT_DEFAULT),
        bool(config.derive),
    )


quant = STRATEGIES.strategy("quant", lossless=False, preset=True)(
    configured(QuantConfig, build_quant)
)


def _fixed(bits: int) -> Callable[..., OpAware]:
    """``quant`` at ``bits``: every option of :class:`QuantConfig` but the width."""
    return functools.partial(quant, bits)


def build_mesa(codec: MesaQuantizer) -> OpAware:
    """Mesa's codec behind the op-aware layer. With ``derive=True`` a LayerNorm's, GELU's,
    SiLU's or BatchNorm's output that a later op saves is recomputed from its coded input, as
    under ``quant.int8``, instead of being coded a second time. The zoo at ``--scale small``,
    one step, stored bytes over stock's (gradient cosine with stock's): GPT 21.4% -> 13.0%
    (0.99994 -> 0.99995), ViT 20.9% -> 12.8% (0.99997 both), ResNet 25.6% -> 18.4% (0.99997
    -> 0.99995). Off by default: Mesa codes every saved tensor, and the quant README's mesa
    figures are of that."""
    return OpAware(codec, derive=codec.derive)


mesa = STRATEGIES.strategy(
    "quant.mesa",
    lossless=False,
    summary="Mesa: 8-bit head-wise codes from running (EMA) ranges, widened: nothing wraps",
)(configured(MesaQuantizer, build_mesa))


@dataclass(frozen=True)
class AutoConfig:
    """Mixed 1/2/4/8-bit under an average budget (default 2), from range x gradient.

    Mixed precision: ``budget`` average bits per saved element, re-allocated every
    ``interval`` steps, twice as far apart each time an allocation repeats the one before, up
    to ``max_interval`` (default 16 x ``interval``; equal to it: a fixed cadence). With ``derive``, LayerNorm, GELU/SiLU and attention outputs are
    recomputed from their stored inputs and count in the average at no bits, so the stored
    codes get wider ones. GELU/SiLU inputs as derivative codes of ``deriv_bits`` (``"auto"``:
    none with ``derive``, whose recomputation needs their values; else 2 below a budget of 4).
    Measured in the demo at budget 2: derive took the final loss from +6.4% over stock at
    14.55x to +1.7% at 14.84x (see the README).
    """

    budget: float = 2.0
    bits: tuple[int, ...] = (1, 2, 4, 8)
    group_size: int = 256
    interval: int = 20
    max_interval: int | None = None
    stochastic: bool = True
    seed: int | None = None
    deriv_bits: int | str | None = "auto"
    derive: bool = True

    def __post_init__(self) -> None:
        """``deriv_bits`` checked here; the widths, budget, group size and interval by the
        codec :func:`build_auto` makes (:class:`~.auto.AutoQuantizer`, which takes them)."""
        check_deriv_bits(self.deriv_bits, "quant.auto", None)


def build_auto(config: AutoConfig) -> OpAware:
    """:class:`AutoConfig`'s handler: the allocating codec, its start widths, its placement."""
    c = config
    values = AutoQuantizer(
        c.budget,
        c.bits,
        c.group_size,
        c.interval,
        c.stochastic,
        c.seed,
        max_interval=c.max_interval,
    )
    if c.derive:
        values.unranked_bits = dict(UNRANKED_BITS)
        values.derive = True
    start = {
        "elementwise": ACT_DEFAULT.get(values.default_bits),
        "norm": AUTO_START_NORM.get(values.default_bits),
    }
    values.start_bits = {kind: bits for kind, bits in start.items() if bits is not None}
    default = None if c.derive or values.budget >= 4 else 2
    width = check_deriv_bits(c.deriv_bits, "quant.auto", default)
    derivs = None if width is None else DerivCoder(width, c.stochastic, c.seed)
    return OpAware(values, derivs=derivs, derive=bool(c.derive))


auto = STRATEGIES.strategy("quant.auto", lossless=False)(configured(AutoConfig, build_auto))


fp8 = STRATEGIES.strategy(
    "quant.fp8", lossless=False, summary="Float codes in e4m3 with a per-group scale"
)(configured(Fp8Quantizer, OpAware))


def level(name: str, group_size: int = 256, seed: int | None = None) -> Compressor | None:
    """The compressor of ActNN level ``name`` (``"L0"`` ... ``"L5"``)."""
    if name not in LEVELS:
        raise OptionError(f"level={name!r} is not an ActNN level; use one of {', '.join(LEVELS)}")
    if name == "L0":
        return None
    if name == "L1":
        inner = quant(4, group_size, True, seed)
        inner.name = "quant.L1"
        return OnlyOps(inner, frozenset({"linear", "conv"}))
    if name == "L2":
        return quant(4, group_size, True, seed)
    codec: Compressor = auto(2.0, group_size=group_size, seed=seed)
    if name in ("L4", "L5"):
        codec = Composed(codec, CpuOffload())
    if name == "L5" and torch.cuda.is_available():
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return codec


def _level_factory(name: str) -> Callable[..., object]:
    def build(group_size: int = 256, seed: int | None = None) -> object:
        codec = level(name, group_size, seed)
        return AS_IS if codec is None else codec  # L0: a factory's None is an error

    build.__name__ = f"level_{name}"
    return build


for _bits in (8, 4, 2, 1):
    STRATEGIES.strategy(
        f"quant.int{_bits}",
        lossless=False,
        summary=f"{_bits}-bit per-group stochastic quantization (ActNN/GACT scheme, fused)",
        candidate=_bits >= 2,  # a memory budget tries int8, int4, int2
    )(_fixed(_bits))
for _name in LEVELS:
    STRATEGIES.strategy(
        f"quant.{_name}", lossless=_name == "L0", summary=SUMMARIES[_name], preset=True
    )(_level_factory(_name))


def register(registry: Registry) -> None:
    STRATEGIES.register(registry)
    registry.register_policy_format(
        "quant.mesa",
        parse_mesa,
        summary="Mesa's policy text (on <tag>: blocks of by_index/enable/level/ema_decay)",
        fallback=True,  # Mesa's files have no suffix of their own
    )
