"""One bit per element: where a tensor is above zero (NaN counts as above), restored as 1.0/0.0.

A ReLU's backward reads only that of its saved output: ``threshold_backward(g, t, 0)`` gives
the same gradient for the output and for this code, NaN included. quant's op-aware codes
(``quant.sign`` for ReLU-like ops) and memsave's ReLU under the engine both store it so, with
this one codec; the bits keep the tensor's memory order, and the code restores its strides.
"""

from __future__ import annotations

import math

import torch

from .compressor import BaseCompressor
from .kernels import pack_mask, sign_pack, sign_unpack, unpack_mask
from .layout import memory_order, restore
from .packed import Packed
from .site import Site

#: the dtypes the one-pass sign kernels take
SIGN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def pack_sign(x: torch.Tensor, codec: str = "sign") -> Packed:
    """``x > 0`` (or NaN) as bits in ``x``'s memory order, recorded under ``codec``: one
    kernel pass (:func:`~torchstash.kernels.sign_pack`) where ``x`` has a memory order and a
    float dtype it takes; the compare, negation and packing otherwise (0.11 ms on a 1 MB ReLU
    output, one thread, against 0.015)."""
    dense, inverse = memory_order(x)
    if x.dtype in SIGN_DTYPES and (inverse is not None or x.is_contiguous()):
        bits = sign_pack(dense)
    else:
        dense, inverse = memory_order(~(x <= 0))
        bits = pack_mask(dense)
    packed = Packed.like(x, codec, bits=bits)
    packed.meta["order"] = inverse
    return packed


def unpack_sign(packed: Packed) -> torch.Tensor:
    """1.0 where the packed tensor was above zero, 0.0 elsewhere, in its dtype and strides."""
    bits = packed.tensors["bits"]
    order = packed.meta.get("order")
    assert isinstance(bits, torch.Tensor) and (order is None or isinstance(order, tuple))
    shape = torch.Size(tuple(packed.shape))
    if packed.dtype in SIGN_DTYPES:
        return restore(sign_unpack(bits, math.prod(shape), packed.dtype), shape, order)
    mask = restore(unpack_mask(bits, math.prod(shape)), shape, order)
    return mask.to(packed.dtype)


class SignBits(BaseCompressor):
    """:func:`pack_sign` as a compressor, for what an op reads only the sign of (a ReLU's
    output): exact for that op's backward, which is why it calls itself lossless."""

    lossless = True
    replays = True  # the bits of the tensor alone

    def __init__(self, name: str = "sign") -> None:
        self.name = name

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        if not x.is_floating_point():
            return [f"{self.name} codes float tensors, got {x.dtype}"]
        return []

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        return pack_sign(x, self.name)

    def decompress(self, packed: Packed) -> torch.Tensor:
        return unpack_sign(packed)
