"""ActNN's Q-layers: torch's layers, with ActNN's extra ``group`` argument, that quantize
what they save for backward on their own, as ActNN's did, whether or not ``QModule`` wraps
them.

Each layer takes the strategy of ``config`` at construction (set the level first, as ActNN
asked) and runs its forward in a :class:`torchstash.stash` block of it while
``config.training`` and the layer's own ``training`` are on; otherwise it is the torch layer.
Inside a ``QModule`` the layer's own block is the innermost and decides for its saves. The
ReLU's, dropout's and max pool's savings (1-bit masks, the pool's in-window positions) come
with every quant strategy. ``QAvgPool2d`` averages (ActNN's ran a max pool).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

import torchstash as ts

from .._arguments import bind
from .conf import config, strategy
from .qbnscheme import QBNScheme
from .qscheme import QScheme


class _Quantized:
    """The stash block a Q-layer runs its forward in (first among a Q-layer's bases, so its
    ``forward`` wraps the torch layer's). A torch layer ``QModule`` converted has none (the
    class defaults): the model's level decides its saves."""

    _actnn_stash: ts.stash | None = None
    scheme: QScheme | None = None

    def _actnn_init(self, scheme: QScheme | None = None) -> None:
        self.scheme = scheme
        name, options = strategy(batchnorm=True)
        module: Any = self
        self._actnn_stash = ts.stash(name, module=module, **options) if name else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        forward = super().forward  # type: ignore[misc]
        block = self._actnn_stash
        module: Any = self
        if block is None or not (config.training and module.training) or block.active:
            return forward(*args, **kwargs)
        with block:
            return forward(*args, **kwargs)


def _conv_scheme(layer: Any, group: int) -> QScheme | None:
    if not config.adaptive_conv_scheme:
        return None
    kernel, locations = layer.kernel_size, 1
    for k in kernel if isinstance(kernel, (tuple, list)) else (kernel,):
        locations *= int(k)
    return QScheme(layer, group=group, num_locations=locations, depthwise_groups=layer.groups)


def _linear_scheme(layer: Any, group: int) -> QScheme | None:
    return QScheme(layer, group=group) if config.adaptive_conv_scheme else None


def _bn_scheme(layer: Any, group: int) -> QBNScheme | None:
    return QBNScheme(group=group) if config.adaptive_bn_scheme else None


Scheme = Callable[[Any, int], "QScheme | QBNScheme | None"]


def _q_layer(
    base: type[nn.Module],
    name: str,
    order: tuple[str, ...],
    scheme: Scheme,
    torch_names: dict[str, str] | None = None,
) -> Any:
    """``base`` with ActNN's extra ``group`` argument, after the layer's ``order`` of
    arguments (positionally or by name; any more of the torch layer's by name; ActNN's names
    for torch's in ``torch_names``), and the quantization scheme ``scheme(layer, group)``."""
    rename = torch_names or {}

    every = (*order, "group")

    def __init__(self: Any, *positional: Any, **named: Any) -> None:
        named = bind(name, every, positional, named)
        group = named.pop("group", 0)
        base.__init__(self, **{rename.get(k, k): v for k, v in named.items()})
        self._actnn_init(scheme(self, group))

    return type(name, (_Quantized, base), {"__init__": __init__})


_CONV: tuple[str, ...] = ("in_channels", "out_channels", "kernel_size", "stride", "padding")
_CONV += ("dilation", "groups", "bias", "padding_mode")
_CONV_T: tuple[str, ...] = ("in_channels", "out_channels", "kernel_size", "stride", "padding")
_CONV_T += ("output_padding", "groups", "bias", "dilation", "padding_mode")
_BN = ("num_features", "eps", "momentum", "affine", "track_running_stats")

QConv1d = _q_layer(nn.Conv1d, "QConv1d", _CONV, _conv_scheme)
QConv2d = _q_layer(nn.Conv2d, "QConv2d", _CONV, _conv_scheme)
QConv3d = _q_layer(nn.Conv3d, "QConv3d", _CONV, _conv_scheme)
QConvTranspose1d = _q_layer(nn.ConvTranspose1d, "QConvTranspose1d", _CONV_T, _conv_scheme)
QConvTranspose2d = _q_layer(nn.ConvTranspose2d, "QConvTranspose2d", _CONV_T, _conv_scheme)
QConvTranspose3d = _q_layer(nn.ConvTranspose3d, "QConvTranspose3d", _CONV_T, _conv_scheme)
QBatchNorm1d = _q_layer(nn.BatchNorm1d, "QBatchNorm1d", _BN, _bn_scheme)
QBatchNorm2d = _q_layer(nn.BatchNorm2d, "QBatchNorm2d", _BN, _bn_scheme)
QBatchNorm3d = _q_layer(nn.BatchNorm3d, "QBatchNorm3d", _BN, _bn_scheme)
QSyncBatchNorm = _q_layer(nn.SyncBatchNorm, "QSyncBatchNorm", (*_BN, "process_group"), _bn_scheme)
QLinear = _q_layer(
    nn.Linear,
    "QLinear",
    ("input_features", "output_features", "bias"),  # ActNN's names
    _linear_scheme,
    {"input_features": "in_features", "output_features": "out_features"},
)
QLinear.num_layers = 0


class QReLU(_Quantized, nn.ReLU):
    """ActNN's took ``inplace`` and ignored it: the input is never overwritten."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__(inplace=False)
        self._actnn_init()


class QDropout(_Quantized, nn.Dropout):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__(p)
        self._actnn_init()


class QMaxPool2d(_Quantized, nn.MaxPool2d):
    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        dilation: Any = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        self._actnn_init()


class QAvgPool2d(_Quantized, nn.AvgPool2d):
    """Averages (ActNN's computed a max pool under this name, with a warning)."""

    def __init__(
        self,
        kernel_size: Any,
        stride: Any = None,
        padding: Any = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> None:
        super().__init__(
            kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        )
        self._actnn_init()


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
    "QReLU",
    "QSyncBatchNorm",
]
