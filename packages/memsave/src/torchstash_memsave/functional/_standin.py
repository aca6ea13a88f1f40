"""Layouts, stand-ins for tensors that were not saved, and masks packed in memory order.

A memsave Function saves only what this step's gradients need and hands stock's backward op
a *stand-in* for the rest. The stand-in's values are never read, but its layout is: CPU
kernels pick their code path (and so their rounding) from shapes, strides and dtypes. So every
stand-in reproduces the original's layout (:class:`Layout`) rather than just its shape:

* the incoming gradient itself when it has the same layout (the norms: no allocation);
* a zero-stride placeholder of one element where the op reads only sizes *and* the original
  was contiguous (pooling, padding): no allocation;
* ``torch.empty_strided`` with the original strides otherwise (convolution copies a zero-stride
  placeholder to full size anyway, and channels_last must stay channels_last). It is
  allocated only for the duration of one backward op.

Masks and small codes are packed in the order their values lie in memory
(:func:`torchstash.layout.memory_order`), so a channels_last mask unpacks channels_last and
the gradient computed from it gets stock's strides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from torchstash.kernels import pack_bits, pack_mask, unpack_bits, unpack_mask
from torchstash.layout import memory_order, restore

__all__ = [
    "Layout",
    "as_uint8",
    "check_inplace",
    "expand",
    "needs_graph",
    "pack_codes",
    "pack_keep_mask",
    "placeholder",
    "standin",
    "suggest_memory_format",
    "unpack_codes",
    "unpack_keep_mask",
]


class Layout(NamedTuple):
    """What a stand-in must reproduce for a backward kernel to take stock's path."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> Layout:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def is_contiguous(self) -> bool:
        """Row-major contiguous (size-1 dimensions may have any stride, as in PyTorch)."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size == 0:
                return True
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def expand(value: int | Sequence[int], nd: int, name: str) -> list[int]:
    """An int or 1 or ``nd`` ints as ``nd`` ints (ATen expands a single value the same way)."""
    if isinstance(value, int):
        return [value] * nd
    values = [int(v) for v in value]
    if len(values) == 1:
        return values * nd
    if len(values) != nd:
        raise ValueError(f"{name} must be an int or {nd} ints, got {value!r}")
    return values


def needs_graph(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record this call: grad mode is on and some input requires grad.

    The functional wrappers call stock PyTorch unchanged otherwise (inference, frozen
    layers), so they can never differ from it where there is nothing to save.
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_inplace(x: torch.Tensor) -> None:
    """Autograd's refusal of an in-place op on a leaf that requires grad, raised *before* the
    op runs (a Function would raise only after its forward has modified the tensor)."""
    if x.is_leaf and x.requires_grad:
        raise RuntimeError(
            "a leaf Variable that requires grad is being used in an in-place operation."
        )
    base = x._base
    if base is not None and base.is_leaf and base.requires_grad:
        raise RuntimeError(
            "a view of a leaf Variable that requires grad is being used in an in-place operation."
        )


def placeholder(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that owns one element (all strides 0), for ops that read sizes."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def standin(
    layout: Layout, *, grad: torch.Tensor | None = None, sizes_only: bool = False
) -> torch.Tensor:
    """A tensor laid out like one that was not saved; its values are never read.

    ``grad`` is returned itself when its shape, strides and dtype match (no allocation);
    ``sizes_only`` allows a zero-stride placeholder when the original was contiguous.
    """
    shape, stride, dtype, device = layout
    if (
        grad is not None
        and tuple(grad.shape) == shape
        and tuple(grad.stride()) == stride
        and grad.dtype == dtype
    ):
        return grad
    if sizes_only and layout.is_contiguous():
        return placeholder(shape, dtype, device)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def _channels_last_strides(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """c10's ``is_channels_last_strides_{2d_s4,3d_s5}`` (the check behind suggest_memory_format)."""
    order = (1, 3, 2, 0) if len(sizes) == 4 else (1, 4, 3, 2, 0)
    if strides[1] == 0:
        return False
    minimum = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < minimum:
            return False
        if d == 0 and minimum == strides[1]:
            return False
        minimum = strides[d]
        if sizes[d] > 1:
            minimum *= sizes[d]
    return True


def suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``Tensor.suggest_memory_format()`` of ATen, which Python does not expose."""
    channels_last = (
        t.layout == torch.strided
        and t.dim() in (4, 5)
        and _channels_last_strides(tuple(t.shape), tuple(t.stride()))
    )
    if channels_last:
        return torch.channels_last if t.dim() == 4 else torch.channels_last_3d
    return torch.contiguous_format


def pack_keep_mask(keep: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(1-D uint8 bits of the bool ``keep`` in memory order, the permutation that restores it)."""
    dense, inverse = memory_order(keep)
    return pack_mask(dense), inverse


def unpack_keep_mask(
    packed: torch.Tensor, shape: tuple[int, ...], inverse: tuple[int, ...] | None
) -> torch.Tensor:
    """The bool mask :func:`pack_keep_mask` packed, with its original strides."""
    return restore(unpack_mask(packed, math.prod(shape)), torch.Size(shape), inverse)


def as_uint8(keep: torch.Tensor) -> torch.Tensor:
    """A bool mask as 0/1 bytes (a view), to cast to a float dtype: from uint8 a vectorized
    cast on CPU, from bool some 7x slower (and a kernel given either to promote in its loop
    copies it first, slower still)."""
    return keep.view(torch.uint8)


def pack_codes(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(1-D uint8 of the uint8 ``codes`` at ``bits`` each in memory order, the permutation)."""
    dense, inverse = memory_order(codes)
    return pack_bits(dense, bits), inverse


def unpack_codes(
    packed: torch.Tensor, bits: int, shape: tuple[int, ...], inverse: tuple[int, ...] | None
) -> torch.Tensor:
    """The uint8 codes :func:`pack_codes` packed, with their original strides."""
    return restore(unpack_bits(packed, bits, math.prod(shape)), torch.Size(shape), inverse)
