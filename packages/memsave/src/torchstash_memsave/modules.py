"""The memory-saving layers: each a subclass of the torch layer whose forward calls
:mod:`.functional`, swapped in place of the module's class.

A class swap keeps everything the module owns (Parameters, buffers, hooks, ``training``,
every constructor argument, ``state_dict`` keys), so nothing is copied and nothing goes stale
while it is applied; the layer reads its attributes at every forward, as the torch layer does.
A subclass of a torch layer gets its own memory-saving subclass, unless it overrides the method
memsave replaces (then it is left as it is, with the reason recorded).

A conv or norm layer whose Function would keep all stock keeps this call (its weight trains)
runs the torch layer's own method: the same saves, at stock's cost (see ``*_spares_nothing``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from torchstash.opmark import as_op, engine_active

from . import functional as MF
from .functional.conv import conv_spares_nothing
from .functional.norm import (
    batch_norm_spares_nothing,
    group_norm_spares_nothing,
    layer_norm_spares_nothing,
)

_UNNAMED = contextlib.nullcontext()


def _as_op(op: str, args: tuple[Any, ...]) -> contextlib.AbstractContextManager[Any]:
    """``as_op``, which names the layer's op for what its Function saves under the engine (a
    stock op's site); with no engine running, nothing to name."""
    return as_op(op, args) if engine_active() else _UNNAMED


class MemSave:
    """Marks a memory-saving layer; ``base`` is the torch layer whose method it replaces."""

    base: ClassVar[type[nn.Module]]
    replaces: ClassVar[str] = "forward"
    family: ClassVar[str]

    @classmethod
    def from_nn(cls, module: nn.Module) -> Any:
        """A memory-saving layer sharing ``module``'s Parameters and buffers (no copy)."""
        if not isinstance(module, cls.base):
            raise TypeError(
                f"{cls.__name__}.from_nn takes a {cls.base.__name__}, got {type(module).__name__}"
            )
        new = copy.copy(module)
        for attr in ("_parameters", "_buffers", "_modules"):
            setattr(new, attr, dict(getattr(module, attr)))
        new.__class__ = memsave_class(type(module))
        return new


# -- convolution ----------------------------------------------------------------------------


class _ConvMixin(MemSave):
    replaces = "_conv_forward"
    family = "conv"

    def _conv_forward(
        self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        m: Any = self
        if conv_spares_nothing(input, weight, m.padding_mode):
            return m.base._conv_forward(m, input, weight, bias)
        with _as_op("conv", (input, weight, bias)):
            return MF.conv(
                input,
                weight,
                bias,
                stride=m.stride,
                padding=m.padding,
                dilation=m.dilation,
                groups=m.groups,
                padding_mode=m.padding_mode,
            )


class _ConvTransposeMixin(MemSave):
    family = "conv"

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        m: Any = self
        if conv_spares_nothing(input, m.weight, m.padding_mode):
            return m.base.forward(m, input, output_size)
        if m.padding_mode != "zeros":
            raise ValueError(
                f"Only 'zeros' padding mode is supported for {m.base.__name__}"  # as torch says
            )
        nd = m.weight.dim() - 2
        output_padding = m._output_padding(
            input, output_size, m.stride, m.padding, m.kernel_size, nd, m.dilation
        )
        with _as_op("conv", (input, m.weight, m.bias)):
            return MF.conv(
                input,
                m.weight,
                m.bias,
                stride=m.stride,
                padding=m.padding,
                dilation=m.dilation,
                groups=m.groups,
                transposed=True,
                output_padding=output_padding,
            )


def _layer_mixin(
    family: str,
    op: str,
    fn: Callable[..., torch.Tensor],
    attrs: tuple[str, ...],
    stock_when: Callable[[Any, torch.Tensor], bool] | None = None,
) -> type[MemSave]:
    """The forward of a layer that is ``fn(input, *its attrs)``, tracked as op ``op`` over the
    input and the attrs that are tensors (weights, or None where the layer has none), or the
    stock layer's own forward where ``stock_when(layer, input)`` says the memory-saving one
    would spare nothing."""

    class _LayerMixin(MemSave):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            m: Any = self
            if stock_when is not None and stock_when(m, input):
                out: torch.Tensor = m.base.forward(m, input)
                return out
            values = [getattr(m, a) for a in attrs]
            operands = [v for a, v in zip(attrs, values, strict=True) if a in _WEIGHTS]
            with _as_op(op, (input, *operands)):
                out = fn(input, *values)
                return out

    _LayerMixin.family = family
    _LayerMixin.__name__ = _LayerMixin.__qualname__ = f"_{op}_mixin"
    return _LayerMixin


#: the attributes of a layer that are the op's tensor operands (see :func:`_layer_mixin`)
_WEIGHTS = frozenset({"weight", "bias"})


# -- normalization --------------------------------------------------------------------------


class _BatchNormMixin(MemSave):
    family = "batchnorm"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        m: Any = self
        if isinstance(m, nn.SyncBatchNorm) and m.training and _distributed():
            return nn.SyncBatchNorm.forward(m, input)  # the synchronised path stays stock's
        bn_training = m.training or (m.running_mean is None and m.running_var is None)
        if batch_norm_spares_nothing(input, m.weight, bn_training):
            return m.base.forward(m, input)
        m._check_input_dim(input)
        with _as_op("batch_norm", (input, m.running_mean, m.running_var, m.weight, m.bias)):
            return MF.module_batch_norm(
                input,
                weight=m.weight,
                bias=m.bias,
                running_mean=m.running_mean,
                running_var=m.running_var,
                num_batches_tracked=m.num_batches_tracked,
                training=m.training,
                track_running_stats=m.track_running_stats,
                momentum=m.momentum,
                eps=m.eps,
            )


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _layer_norm_stock(m: Any, x: torch.Tensor) -> bool:
    return layer_norm_spares_nothing(x, m.weight, m.bias)


def _group_norm_stock(m: Any, x: torch.Tensor) -> bool:
    return group_norm_spares_nothing(x)


_NORM = ("weight", "bias", "eps")
_LayerNormMixin = _layer_mixin(
    "layernorm", "layer_norm", MF.layer_norm, ("normalized_shape", *_NORM), _layer_norm_stock
)
_GroupNormMixin = _layer_mixin(
    "groupnorm", "group_norm", MF.group_norm, ("num_groups", *_NORM), _group_norm_stock
)
_RMSNormMixin = _layer_mixin(
    "rmsnorm", "rms_norm", MF.rms_norm, ("normalized_shape", "weight", "eps")
)


# -- activations, dropout, pooling ----------------------------------------------------------


class _ReLUMixin(MemSave):
    """``MF.relu``, which names its op itself under the engine (a ReLU is every few layers of
    a CNN: no second name around it)."""

    family = "relu"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.relu(input, self.inplace)  # type: ignore[attr-defined]


_LeakyReLUMixin = _layer_mixin("relu", "leaky_relu", MF.leaky_relu, ("negative_slope", "inplace"))
_HardtanhMixin = _layer_mixin("relu", "hardtanh", MF.hardtanh, ("min_val", "max_val", "inplace"))
_DropoutMixin = _layer_mixin("dropout", "dropout", MF.dropout, ("p", "training", "inplace"))
_AlphaDropoutMixin = _layer_mixin(
    "dropout", "alpha_dropout", MF.alpha_dropout, ("p", "training", "inplace")
)


def _max_pool_mixin(fn: Callable[..., Any]) -> type[MemSave]:
    class _MaxPoolMixin(MemSave):
        family = "maxpool"

        def forward(self, input: torch.Tensor) -> Any:
            m: Any = self
            with _as_op("max_pool", (input,)):
                return fn(
                    input,
                    m.kernel_size,
                    m.stride,
                    m.padding,
                    m.dilation,
                    ceil_mode=m.ceil_mode,
                    return_indices=m.return_indices,
                )

    return _MaxPoolMixin


def _avg_pool_mixin(fn: Callable[..., Any], divisor: bool) -> type[MemSave]:
    class _AvgPoolMixin(MemSave):
        family = "avgpool"

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            m: Any = self
            extra = (m.divisor_override,) if divisor else ()
            with _as_op("avg_pool", (input,)):
                out: torch.Tensor = fn(
                    input,
                    m.kernel_size,
                    m.stride,
                    m.padding,
                    m.ceil_mode,
                    m.count_include_pad,
                    *extra,
                )
                return out

    return _AvgPoolMixin


def _adaptive_avg_pool_mixin(fn: Callable[..., Any]) -> type[MemSave]:
    class _AdaptiveAvgPoolMixin(MemSave):
        family = "avgpool"

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            with _as_op("avg_pool", (input,)):
                out: torch.Tensor = fn(input, self.output_size)  # type: ignore[attr-defined]
                return out

    return _AdaptiveAvgPoolMixin


#: torch layer -> the mixin that makes it save less. Order matters only for reading.
MIXINS: dict[type[nn.Module], type[MemSave]] = {
    nn.Conv1d: _ConvMixin,
    nn.Conv2d: _ConvMixin,
    nn.Conv3d: _ConvMixin,
    nn.ConvTranspose1d: _ConvTransposeMixin,
    nn.ConvTranspose2d: _ConvTransposeMixin,
    nn.ConvTranspose3d: _ConvTransposeMixin,
    nn.BatchNorm1d: _BatchNormMixin,
    nn.BatchNorm2d: _BatchNormMixin,
    nn.BatchNorm3d: _BatchNormMixin,
    nn.SyncBatchNorm: _BatchNormMixin,
    nn.LayerNorm: _LayerNormMixin,
    nn.GroupNorm: _GroupNormMixin,
    nn.RMSNorm: _RMSNormMixin,
    nn.ReLU: _ReLUMixin,
    nn.LeakyReLU: _LeakyReLUMixin,
    nn.Hardtanh: _HardtanhMixin,  # ReLU6 is a Hardtanh
    nn.Dropout: _DropoutMixin,
    nn.AlphaDropout: _AlphaDropoutMixin,
    nn.MaxPool1d: _max_pool_mixin(MF.max_pool1d),
    nn.MaxPool2d: _max_pool_mixin(MF.max_pool2d),
    nn.MaxPool3d: _max_pool_mixin(MF.max_pool3d),
    nn.AvgPool1d: _avg_pool_mixin(MF.avg_pool1d, divisor=False),
    nn.AvgPool2d: _avg_pool_mixin(MF.avg_pool2d, divisor=True),
    nn.AvgPool3d: _avg_pool_mixin(MF.avg_pool3d, divisor=True),
    nn.AdaptiveAvgPool1d: _adaptive_avg_pool_mixin(MF.adaptive_avg_pool1d),
    nn.AdaptiveAvgPool2d: _adaptive_avg_pool_mixin(MF.adaptive_avg_pool2d),
    nn.AdaptiveAvgPool3d: _adaptive_avg_pool_mixin(MF.adaptive_avg_pool3d),
}
#: memsave_torch's flags and ours: each family a layer belongs to.
FAMILIES = (
    "conv",
    "batchnorm",
    "layernorm",
    "groupnorm",
    "rmsnorm",
    "relu",
    "dropout",
    "maxpool",
    "avgpool",
)

_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}


def torch_base(cls: type[nn.Module]) -> type[nn.Module] | None:
    """The torch layer in ``cls``'s ancestry that memsave knows (nearest first), or None."""
    for klass in cls.__mro__:
        if klass in MIXINS:
            return klass
    return None


def why_not(module: nn.Module) -> str | None:
    """None when ``module`` can be swapped for its memory-saving class; else why not."""
    cls = type(module)
    if isinstance(module, MemSave):
        return "already a memory-saving layer"
    base = torch_base(cls)
    if base is None:
        return f"{cls.__name__}: no memory-saving layer for this type"
    method = MIXINS[base].replaces
    if getattr(cls, method) is not getattr(base, method):
        return (
            f"{cls.__name__} overrides {base.__name__}.{method}, which memsave replaces: "
            "left as it is"
        )
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in module.parameters(False)):
        return f"{cls.__name__} is lazy and not initialised yet: run one forward first"
    return None


def memsave_class(cls: type[nn.Module]) -> type[nn.Module]:
    """The memory-saving subclass of ``cls`` (made once per class)."""
    made = _CLASSES.get(cls)
    if made is None:
        base = torch_base(cls)
        if base is None:
            raise TypeError(f"memsave has no memory-saving layer for {cls.__name__}")
        mixin = MIXINS[base]
        made = type(f"MemSave{cls.__name__}", (mixin, cls), {"base": base, "__module__": __name__})
        _CLASSES[cls] = made
    return made


def _named(base: type[nn.Module]) -> type[Any]:
    cls = memsave_class(base)

    def from_nn(klass: type[Any], module: nn.Module) -> Any:
        return MemSave.from_nn.__func__(klass, module)  # type: ignore[attr-defined]

    setattr(cls, f"from_nn_{base.__name__}", classmethod(from_nn))
    return cls


MemSaveConv1d = _named(nn.Conv1d)
MemSaveConv2d = _named(nn.Conv2d)
MemSaveConv3d = _named(nn.Conv3d)
MemSaveConvTranspose1d = _named(nn.ConvTranspose1d)
MemSaveConvTranspose2d = _named(nn.ConvTranspose2d)
MemSaveConvTranspose3d = _named(nn.ConvTranspose3d)
MemSaveBatchNorm1d = _named(nn.BatchNorm1d)
MemSaveBatchNorm2d = _named(nn.BatchNorm2d)
MemSaveBatchNorm3d = _named(nn.BatchNorm3d)
MemSaveSyncBatchNorm = _named(nn.SyncBatchNorm)
MemSaveLayerNorm = _named(nn.LayerNorm)
MemSaveGroupNorm = _named(nn.GroupNorm)
MemSaveRMSNorm = _named(nn.RMSNorm)
MemSaveReLU = _named(nn.ReLU)
MemSaveLeakyReLU = _named(nn.LeakyReLU)
MemSaveHardtanh = _named(nn.Hardtanh)
MemSaveReLU6 = _named(nn.ReLU6)
MemSaveDropout = _named(nn.Dropout)
MemSaveAlphaDropout = _named(nn.AlphaDropout)
MemSaveMaxPool1d = _named(nn.MaxPool1d)
MemSaveMaxPool2d = _named(nn.MaxPool2d)
MemSaveMaxPool3d = _named(nn.MaxPool3d)
MemSaveAvgPool1d = _named(nn.AvgPool1d)
MemSaveAvgPool2d = _named(nn.AvgPool2d)
MemSaveAvgPool3d = _named(nn.AvgPool3d)
MemSaveAdaptiveAvgPool1d = _named(nn.AdaptiveAvgPool1d)
MemSaveAdaptiveAvgPool2d = _named(nn.AdaptiveAvgPool2d)
MemSaveAdaptiveAvgPool3d = _named(nn.AdaptiveAvgPool3d)
# memsave_torch spelled the dropout constructor in lower case
MemSaveDropout.from_nn_dropout = MemSaveDropout.from_nn_Dropout
# memsave_torch's MemSaveConv2d also took ConvTranspose2d (its flags cover both)
for _conv, _transposed in (
    (MemSaveConv1d, MemSaveConvTranspose1d),
    (MemSaveConv2d, MemSaveConvTranspose2d),
    (MemSaveConv3d, MemSaveConvTranspose3d),
):
    _name = f"from_nn_{_transposed.base.__name__}"
    setattr(_conv, _name, getattr(_transposed, _name))
