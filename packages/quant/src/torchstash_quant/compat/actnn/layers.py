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

from typing import Any

from torch import nn

import torchstash as ts

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


def _conv_scheme(layer: nn.Module, group: int, kernel: Any, groups: int) -> QScheme | None:
    if not config.adaptive_conv_scheme:
        return None
    locations = 1
    for k in kernel if isinstance(kernel, (tuple, list)) else (kernel,):
        locations *= int(k)
    return QScheme(layer, group=group, num_locations=locations, depthwise_groups=groups)


def _conv(base: type[nn.Module], name: str) -> type[nn.Module]:
    def __init__(
        self: Any,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        dilation: Any = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        group: int = 0,
        **kw: Any,
    ) -> None:
        base.__init__(
            self, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
            bias, padding_mode, **kw,
        )  # fmt: skip
        self._actnn_init(_conv_scheme(self, group, self.kernel_size, groups))

    return type(name, (_Quantized, base), {"__init__": __init__})


def _conv_transpose(base: type[nn.Module], name: str) -> type[nn.Module]:
    def __init__(
        self: Any,
        in_channels: int,
        out_channels: int,
        kernel_size: Any,
        stride: Any = 1,
        padding: Any = 0,
        output_padding: Any = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: Any = 1,
        padding_mode: str = "zeros",
        group: int = 0,
        **kw: Any,
    ) -> None:
        base.__init__(
            self, in_channels, out_channels, kernel_size, stride, padding, output_padding,
            groups, bias, dilation, padding_mode, **kw,
        )  # fmt: skip
        self._actnn_init(_conv_scheme(self, group, self.kernel_size, groups))

    return type(name, (_Quantized, base), {"__init__": __init__})


def _batchnorm(base: type[nn.Module], name: str) -> type[nn.Module]:
    def __init__(
        self: Any,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group: int = 0,
        **kw: Any,
    ) -> None:
        base.__init__(self, num_features, eps, momentum, affine, track_running_stats, **kw)
        self._actnn_init(QBNScheme(group=group) if config.adaptive_bn_scheme else None)

    return type(name, (_Quantized, base), {"__init__": __init__})


QConv1d = _conv(nn.Conv1d, "QConv1d")
QConv2d = _conv(nn.Conv2d, "QConv2d")
QConv3d = _conv(nn.Conv3d, "QConv3d")
QConvTranspose1d = _conv_transpose(nn.ConvTranspose1d, "QConvTranspose1d")
QConvTranspose2d = _conv_transpose(nn.ConvTranspose2d, "QConvTranspose2d")
QConvTranspose3d = _conv_transpose(nn.ConvTranspose3d, "QConvTranspose3d")
QBatchNorm1d = _batchnorm(nn.BatchNorm1d, "QBatchNorm1d")
QBatchNorm2d = _batchnorm(nn.BatchNorm2d, "QBatchNorm2d")
QBatchNorm3d = _batchnorm(nn.BatchNorm3d, "QBatchNorm3d")


class QLinear(_Quantized, nn.Linear):
    num_layers = 0

    def __init__(
        self,
        input_features: int,
        output_features: int,
        bias: bool = True,
        group: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(input_features, output_features, bias, **kw)
        self._actnn_init(QScheme(self, group=group) if config.adaptive_conv_scheme else None)


class QSyncBatchNorm(_Quantized, nn.SyncBatchNorm):
    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        group: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, process_group, **kw
        )
        self._actnn_init(QBNScheme(group=group) if config.adaptive_bn_scheme else None)


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
