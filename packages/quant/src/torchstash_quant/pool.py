"""Max-pool indices as positions in their windows: a 3x3 window's argmax in 4 bits, not 64.

A 2-d max pool saves, besides its input, the flat index (int64) of each output's maximum in
its input plane. Read with the pool's kernel, stride, padding and dilation (from the call's
arguments), each index is stored as its position inside its window, packed at
:func:`~torchstash.windows.window_bits` bits (2x2: 2 bits, 3x3: 4), exactly. On the bench
zoo's ResNet the stem pool's indices were a fifth of everything ``quant.int8`` kept.

Compressing checks the positions give the indices back (in the same kernel pass on the CPU;
on CUDA, one host synchronisation per pool): indices this module misreads are left as they
are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchstash.packed import Packed
from torchstash.windows import code_indices, indices_from_code

#: Raw function names of the 2-d max pool whose indices this code stores.
POOL_FUNCS = frozenset({"max_pool2d", "max_pool2d_with_indices"})
CODEC = "quant.pool_positions"

#: (H, W, kernel h, kernel w, stride h, stride w, padding h, padding w, dilation h, dilation w)
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
    """The :data:`Geometry` of the running ``max_pool2d`` call, or None when its arguments are
    not plain integers."""

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
    return (int(x.shape[-2]), int(x.shape[-1]), *kernel, *stride, *padding, *dilation)


def pack_pool_positions(indices: torch.Tensor, g: Geometry) -> Packed | None:
    """``indices`` as positions in their windows, or None when a window holds more than 256
    positions or the positions do not give the indices back."""
    coded = code_indices(indices, g[0:2], g[2:4], g[4:6], g[6:8], g[8:10])
    if coded is None:
        return None
    codes, bits = coded
    packed = Packed.like(indices, CODEC, codes=codes)
    packed.meta.update(bits=bits, geometry=g)
    return packed


def unpack_pool_positions(packed: Packed) -> torch.Tensor:
    codes, g, bits = packed.tensors["codes"], packed.meta["geometry"], packed.meta["bits"]
    assert isinstance(codes, torch.Tensor) and isinstance(g, tuple) and isinstance(bits, int)
    return indices_from_code(codes, packed.shape, g[0:2], g[2:4], g[4:6], g[6:8], g[8:10], bits)
