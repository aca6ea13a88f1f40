"""Every registered strategy that builds a compressor passes the core's contract suite, with
its own options' defaults: the day a strategy is registered, it is held to the contract here
(as timm tests every registered model). Each plug-in's own suite holds its codecs to tighter
bounds; this one holds everything installed to the same rules.

A strategy whose nature puts it outside a default knob says so in ``KNOBS``, with the reason.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import torchstash as ts
from torchstash.compressor import Compressor
from torchstash.testing.contract import CompressorContract

#: knob -> value for the strategies that need one, and why
KNOBS: dict[str, dict[str, Any]] = {
    # on the host: the same bytes, elsewhere (its own suite runs it on CUDA)
    "offload.cpu": {"expect_smaller": False, "devices": ("cuda",)},
    # keep 10% of each tensor (min_numel=4096: smaller ones are declined, with the reason): a
    # dropped value reads back as zero (random's kept ones are rescaled by 1 / (1 - p))
    "dropit.mink": {"max_error": 1.0, "min_grad_cosine": 0.3, "declines_below": 4096},
    "dropit.random": {"max_error": 10.0, "min_grad_cosine": 0.1, "declines_below": 4096},
    # one or two bits per element: the codes' error is a share of the range, by design
    "quant.int1": {"max_error": 1.0, "min_grad_cosine": 0.2},  # measured 0.33: memory first
    "quant.int2": {"max_error": 0.7, "min_grad_cosine": 0.7},
    "quant.auto": {"max_error": 1.0, "min_grad_cosine": 0.5},
    "quant.L3": {"max_error": 1.0, "min_grad_cosine": 0.5},
    "quant.L4": {"max_error": 1.0, "min_grad_cosine": 0.5, "devices": ("cuda",)},
    "quant.L5": {"max_error": 1.0, "min_grad_cosine": 0.5, "devices": ("cuda",)},
    # four bits: an eighth of the range at most
    "quant.int4": {"max_error": 0.15},
    "quant.L1": {"max_error": 0.15},
    "quant.L2": {"max_error": 0.15},
    "quant": {"max_error": 0.01},
    "quant.int8": {"max_error": 0.01},
    "quant.mesa": {"max_error": 0.02},
    "quant.fp8": {"max_error": 0.07},
}


def _compressor_strategies() -> list[str]:
    names = []
    for spec in ts.REGISTRY.strategies():
        if isinstance(spec.create(), Compressor):
            names.append(spec.name)
    return names


def _contract(name: str) -> type[CompressorContract]:
    spec = ts.REGISTRY.get(name)
    knobs = dict(KNOBS.get(name, {}))
    f32_only = knobs.pop("expect_smaller_f32_only", False)
    expect_smaller = knobs.pop("expect_smaller", True)

    class Contract(CompressorContract):
        lossless: ClassVar[bool] = spec.lossless

        def make_compressor(self) -> Compressor:
            built = ts.REGISTRY.get(name).create()
            assert isinstance(built, Compressor)
            return built

        def expect_smaller(self, dtype: torch.dtype) -> bool:
            return expect_smaller and (dtype == torch.float32 or not f32_only)

    for knob, value in knobs.items():
        setattr(Contract, knob, value)
    Contract.__name__ = Contract.__qualname__ = f"TestContract_{name.replace('.', '_')}"
    return Contract


for _name in _compressor_strategies():
    _cls = _contract(_name)
    globals()[_cls.__name__] = _cls
del _name, _cls


def test_every_compressor_strategy_is_held_to_the_contract() -> None:
    held = {n.removeprefix("TestContract_") for n in globals() if n.startswith("TestContract_")}
    assert held == {n.replace(".", "_") for n in _compressor_strategies()}
    assert {"quant_int8", "dropit_mink", "offload_cpu"} <= held
