"""``memsave_torch.nn``'s names: ``import torchstash_memsave.compat as memsave_torch`` and
``memsave_torch.nn.convert_to_memory_saving(...)``, ``memsave_torch.nn.MemSaveConv2d``,
``memsave_torch.nn.functional.convMemSave`` run as they did."""

from __future__ import annotations

from torch import nn as _nn

from ...modules import (
    MemSaveBatchNorm2d,
    MemSaveConv1d,
    MemSaveConv2d,
    MemSaveConv3d,
    MemSaveConvTranspose1d,
    MemSaveConvTranspose2d,
    MemSaveConvTranspose3d,
    MemSaveDropout,
    MemSaveLayerNorm,
    MemSaveMaxPool2d,
    MemSaveReLU,
)
from ..convert import convert_to_memory_saving, recursive_setattr
from . import functional


class MemSaveLinear(_nn.Linear):
    """memsave_torch's earlier Linear: stock's own, which already keeps the input only for
    the weight gradient and the weight only for the input gradient."""

    @classmethod
    def from_nn_Linear(cls, linear: _nn.Linear) -> MemSaveLinear:
        """A layer sharing ``linear``'s Parameters."""
        new = cls.__new__(cls)
        _nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.train(linear.training)
        return new


__all__ = [
    "MemSaveBatchNorm2d",
    "MemSaveConv1d",
    "MemSaveConv2d",
    "MemSaveConv3d",
    "MemSaveConvTranspose1d",
    "MemSaveConvTranspose2d",
    "MemSaveConvTranspose3d",
    "MemSaveDropout",
    "MemSaveLayerNorm",
    "MemSaveLinear",
    "MemSaveMaxPool2d",
    "MemSaveReLU",
    "convert_to_memory_saving",
    "functional",
    "recursive_setattr",
]
