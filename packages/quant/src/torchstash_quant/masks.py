"""Exact 1-bit codes for what only needs one bit: a ReLU's saved result and boolean masks.

ReLU's backward reads only whether its saved result is positive (LeakyReLU: whether its input
is), so a sign bit restores a tensor that gives the same gradient bit for bit. Dropout and
masked ops save bool masks, one byte per element in stock PyTorch: packed, one bit.
"""

from __future__ import annotations

import torch

from torchstash.kernels import pack_mask, unpack_mask
from torchstash.packed import Packed
from torchstash.signs import pack_sign, unpack_sign

#: Ops whose saved tensor is used only through ``> 0`` in backward.
SIGN_OPS = frozenset({"relu", "leaky_relu"})


def pack_bool(x: torch.Tensor) -> Packed:
    return Packed.like(x, "quant.bool", bits=pack_mask(x.contiguous()))


def unpack_bool(packed: Packed) -> torch.Tensor:
    bits = packed.tensors["bits"]
    assert isinstance(bits, torch.Tensor)
    return unpack_mask(bits, packed.numel).view(packed.shape)


#: the core's sign bits, one kernel pass each way (kept under these names for the codes here)
pack_signs = pack_sign
unpack_signs = unpack_sign


#: Ops whose saved float tensor is a scaled keep-mask: 0 or 1 / (1 - p) (dropout on CPU).
DROPOUT_OPS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "feature_dropout"})


def pack_scaled_mask(x: torch.Tensor) -> Packed:
    """A dropout mask whose kept entries all hold one value: one bit each, plus that value."""
    p = Packed.like(x, "quant.scaled_mask", bits=pack_mask((x != 0).contiguous()))
    p.tensors["scale"] = x.detach().amax().reshape(1)
    return p


def unpack_scaled_mask(packed: Packed) -> torch.Tensor:
    bits, scale = packed.tensors["bits"], packed.tensors["scale"]
    assert isinstance(bits, torch.Tensor) and isinstance(scale, torch.Tensor)
    keep = unpack_mask(bits, packed.numel).view(packed.shape)
    return keep.to(packed.dtype) * scale.to(packed.dtype)
