"""Max-pool indices as window offsets: a 3x3 window's argmax in 4 bits instead of 64.

A 2-d max pool saves, besides its input, the flat position (int64) of each output's maximum
in its input plane. The window an output reads is fixed by the pool's kernel, stride, padding
and dilation, so that position is the window's origin plus one of ``kh * kw`` offsets: stored
as the offset, in 4 bits for windows of up to 16 elements (8 bits up to 256), exactly. On
ResNet's stem pool the indices are as large as the pool's output at fp64; they were a fifth
of everything ``quant.int8`` kept on the bench zoo's ResNet.

Compressing checks every offset falls inside its window (one reduction; on CUDA, one host
synchronisation): indices that do not (a pool this module misreads) are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchstash.kernels import pack_bits, unpack_bits
from torchstash.packed import Packed

#: Raw function names of the 2-d max pool whose indices this code stores.
POOL_FUNCS = frozenset({"max_pool2d", "max_pool2d_with_indices"})
CODEC = "quant.pool_offsets"

Geometry = tuple[int, int, int, int, int, int, int, int, int, int]


def _pair(value: Any, default: tuple[int, int]) -> tuple[int, int] | None:
    if value is None or (isinstance(value, (tuple, list)) and len(value) == 0):
        return default
    if isinstance(value, int) and not isinstance(value, bool):
        return (value, value)
    if (
        isinstance(value, (tuple, list))
        and len(value) in (1, 2)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return (value[0], value[-1])
    return None


def pool_geometry(args: Sequence[Any], kwargs: dict[str, Any]) -> Geometry | None:
    """(H, W, kh, kw, sh, sw, ph, pw, dh, dw) of the running ``max_pool2d`` call, or None
    when its arguments are not plain integers."""

    def arg(name: str, pos: int, default: Any = None) -> Any:
        if name in kwargs:
            return kwargs[name]
        return args[pos] if len(args) > pos else default

    x = arg("input", 0)
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
        return None
    kernel = _pair(arg("kernel_size", 1), (0, 0))
    if kernel is None or min(kernel) < 1:
        return None
    stride = _pair(arg("stride", 2), kernel)
    padding = _pair(arg("padding", 3, 0), (0, 0))
    dilation = _pair(arg("dilation", 4, 1), (1, 1))
    if stride is None or padding is None or dilation is None:
        return None
    h, w = int(x.shape[-2]), int(x.shape[-1])
    return (h, w, *kernel, *stride, *padding, *dilation)


def _origins(
    shape: torch.Size, g: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    sh, sw, ph, pw = g[4:8]
    oy = torch.arange(shape[-2], device=device).view(-1, 1) * sh - ph
    ox = torch.arange(shape[-1], device=device).view(1, -1) * sw - pw
    return oy, ox


def pack_pool_offsets(indices: torch.Tensor, g: Geometry) -> Packed | None:
    """``indices`` as window offsets, or None when the window is too large or an index lies
    outside its window."""
    h, w, kh, kw, _, _, _, _, dh, dw = g
    window = kh * kw
    bits = 4 if window <= 16 else 8 if window <= 256 else 0
    if not bits or indices.dim() < 2:
        return None
    oy, ox = _origins(indices.shape, g, indices.device)
    ry, rx = indices.div(w, rounding_mode="floor") - oy, indices.remainder(w) - ox
    dy, dx = ry.div(dh, rounding_mode="floor"), rx.div(dw, rounding_mode="floor")
    inside = (
        ((ry == dy * dh) & (rx == dx * dw) & (dy >= 0) & (dy < kh) & (dx >= 0) & (dx < kw))
        & (indices >= 0)
        & (indices < h * w)
    )
    if not bool(inside.all()):
        return None
    codes = (dy * kw + dx).to(torch.uint8)
    packed = Packed.like(indices, CODEC, codes=pack_bits(codes, bits))
    packed.meta.update(bits=bits, geometry=g)
    return packed


def unpack_pool_offsets(packed: Packed) -> torch.Tensor:
    codes = packed.tensors["codes"]
    assert isinstance(codes, torch.Tensor)
    g = packed.meta["geometry"]
    assert isinstance(g, tuple) and len(g) == 10
    _, w, _, kw, _, _, _, _, dh, dw = g
    bits = packed.meta["bits"]
    assert isinstance(bits, int)
    offsets = unpack_bits(codes, bits, packed.numel).view(packed.shape).to(torch.int64)
    oy, ox = _origins(packed.shape, g, codes.device)
    dy, dx = offsets.div(kw, rounding_mode="floor"), offsets.remainder(kw)
    return (oy + dy * dh) * w + (ox + dx * dw)
