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
from .kernels import pack_mask, sign_pack, sign_select, sign_unpack, unpack_mask
from .layout import memory_order, restore
from .packed import Packed
from .site import Site

#: the dtypes the one-pass sign kernels take
SIGN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def sign_bits(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(``x > 0`` or NaN as bits in ``x``'s memory order, the permutation that restores that
    order): one kernel pass (:func:`~torchstash.kernels.sign_pack`) where ``x`` has a memory
    order and a float dtype it takes; the compare, negation and packing otherwise (0.11 ms on
    a 1 MB ReLU output, one thread, against 0.015)."""
    dense, inverse = memory_order(x)
    if x.dtype in SIGN_DTYPES and (inverse is not None or x.is_contiguous()):
        return sign_pack(dense), inverse
    dense, inverse = memory_order(~(x <= 0))
    return pack_mask(dense), inverse


def sign_values(
    bits: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    order: tuple[int, ...] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """1.0 where :func:`sign_bits` set a bit, 0.0 elsewhere, in ``dtype`` and the strides of
    the tensor it packed: one kernel pass for the float dtypes it takes."""
    shape = torch.Size(shape)
    if dtype in SIGN_DTYPES:
        return restore(sign_unpack(bits, math.prod(shape), dtype), shape, order)
    return restore(unpack_mask(bits, math.prod(shape)), shape, order).to(dtype)


def sign_gradient(
    grad: torch.Tensor,
    bits: torch.Tensor,
    shape: tuple[int, ...] | torch.Size,
    order: tuple[int, ...] | None,
) -> torch.Tensor:
    """A ReLU's input gradient, ``threshold_backward(grad, out, 0)``, from the :func:`sign_bits`
    of its output: one kernel pass (:func:`~torchstash.kernels.sign_select`: it reads an
    eighth of the output stock reads) where ``grad`` lies in memory in the bits' order, as it
    does behind a conv or a norm; else the bits as 1.0/0.0 with the gradient written over
    them. Bit for bit stock's, NaN and -0.0 included, in ``grad``'s strides."""
    if grad.dtype in SIGN_DTYPES and grad.device.type == "cpu":  # its kernel, or reference
        dense, grad_order = memory_order(grad)
        if grad_order == order and (order is not None or grad.is_contiguous()):
            return restore(sign_select(dense, bits), torch.Size(shape), order)
    values = sign_values(bits, shape, order, grad.dtype)
    threshold = torch.ops.aten.threshold_backward
    if values.stride() == grad.stride():  # one full-size buffer, as stock's backward
        return threshold.grad_input(grad, values, 0, grad_input=values)
    return threshold(grad, values, 0)


def pack_sign(x: torch.Tensor, codec: str = "sign") -> Packed:
    """:func:`sign_bits` of ``x``, recorded under ``codec``."""
    bits, inverse = sign_bits(x)
    packed = Packed.like(x, codec, bits=bits)
    packed.meta["order"] = inverse
    return packed


def unpack_sign(packed: Packed) -> torch.Tensor:
    """1.0 where the packed tensor was above zero, 0.0 elsewhere, in its dtype and strides."""
    bits = packed.tensors["bits"]
    order = packed.meta.get("order")
    assert isinstance(bits, torch.Tensor) and (order is None or isinstance(order, tuple))
    return sign_values(bits, tuple(packed.shape), order, packed.dtype)


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
