"""Drop-in for ActNN users: ``set_optimization_level``, ``QModule``, ``config`` and the Q-layers.

    import torchstash_quant.compat.actnn as actnn
    actnn.set_optimization_level("L3")
    model = actnn.QModule(model)          # weights kept (ActNN built fresh layers)

``QModule`` applies the level (``quant.L0`` ... ``quant.L5``) to the model through torchstash,
in place: no layer is rebuilt, so weights and BatchNorm statistics stay, and its ``state_dict``
is the wrapped model's own (keys unchanged). The Q-layers are the torch layers under ActNN's
names, for code written against ActNN; they compute exactly what the torch layers compute
(``QAvgPool2d`` averages: ActNN's ran a max-pool).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

import torchstash as ts
from torchstash.errors import OptionError

from ..levels import LEVELS


class QuantizationConfig:
    """ActNN's global settings that mean something here."""

    def __init__(self) -> None:
        self.level = "L3"
        #: bits of the quantized activations; ActNN's first entry (its layer-group list)
        self.activation_compression_bits: list[int] = [2, 8, 8]
        self.group_size = 256
        self.seed: int | None = None


config = QuantizationConfig()


def set_optimization_level(level: str) -> None:
    if level not in LEVELS and level != "L3.1":
        raise OptionError(f"unknown ActNN level {level!r}; use one of {', '.join(LEVELS)}")
    config.level = "L3" if level == "L3.1" else level
    bits = {"L0": 32, "L1": 4, "L2": 4}.get(config.level, 2)
    config.activation_compression_bits = [bits, 8, 8]


def _strategy() -> tuple[str, dict[str, Any]]:
    bits = config.activation_compression_bits[0]
    default = {"L0": 32, "L1": 4, "L2": 4}.get(config.level, 2)
    options: dict[str, Any] = {"group_size": config.group_size, "seed": config.seed}
    if bits != default and config.level in ("L2", "L3"):
        if bits not in (1, 2, 4, 8):
            raise OptionError(f"config.activation_compression_bits[0]={bits!r}: use 1, 2, 4 or 8")
        if config.level == "L3":  # ActNN's L3 bits are an average over a mixed allocation
            return "quant.auto", {**options, "budget": bits}
        return f"quant.int{bits}", options
    return f"quant.{config.level}", options


class QModule(nn.Module):
    """The model, with ActNN's current level applied through torchstash."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        strategy, options = _strategy()
        self.handle = ts.apply(model, strategy, **options)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # the wrapped model's keys
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        return self.model.load_state_dict(state_dict, *args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters(*args, **kwargs)

    def remove(self) -> nn.Module:
        """Take torchstash off and return the plain model."""
        self.handle.remove()
        return self.model


# The Q-layers: torch's layers under ActNN's names.
QConv1d, QConv2d, QConv3d = nn.Conv1d, nn.Conv2d, nn.Conv3d
QConvTranspose1d, QConvTranspose2d, QConvTranspose3d = (
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)
QBatchNorm1d, QBatchNorm2d, QBatchNorm3d = nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d
QSyncBatchNorm = nn.SyncBatchNorm
QLinear, QReLU, QDropout = nn.Linear, nn.ReLU, nn.Dropout
QMaxPool2d, QAvgPool2d = nn.MaxPool2d, nn.AvgPool2d

__all__ = [
    "QAvgPool2d",
    "QBatchNorm1d",
    "QBatchNorm2d",
    "QBatchNorm3d",
    "QConv1d",
    "QConv2d",
    "QConv3d",
    "QConvTranspose1d",
    "QConvTranspose2d",
    "QConvTranspose3d",
    "QDropout",
    "QLinear",
    "QMaxPool2d",
    "QModule",
    "QReLU",
    "QSyncBatchNorm",
    "QuantizationConfig",
    "config",
    "set_optimization_level",
]
