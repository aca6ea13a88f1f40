"""Memory order: compress a tensor's values in the order they lie in memory, restore its strides.

A transposed or channels_last tensor is dense, just not row-major: permuting it to its memory
order is a free view, so a compressor never needs a copy, and the restored tensor gets the
original strides back (channels_last stays channels_last).
"""

from __future__ import annotations

from typing import Any

import torch


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(view of ``x`` that is row-major contiguous, the permutation that undoes it) when
    ``x`` is a dense permutation of a contiguous tensor; else (``x.contiguous()``, None)."""
    order = None if x.is_contiguous() else _permutation(x)
    if order is None:
        return x.contiguous(), None
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return x.permute(order), tuple(inverse)


def _permutation(x: torch.Tensor) -> tuple[int, ...] | None:
    """The dimensions of ``x`` from outermost to innermost in memory when permuting them so
    makes it contiguous, else None; read from the strides, never by a copy."""
    if x.dim() < 2:
        return None
    order = tuple(sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d])))
    return order if x.permute(order).is_contiguous() else None


def restore(flat: torch.Tensor, shape: torch.Size, inverse: tuple[int, ...] | None) -> torch.Tensor:
    """The tensor of ``shape`` whose values ``flat`` holds in the order :func:`memory_order` chose."""
    if inverse is None:
        return flat.view(shape)
    order = [0] * len(inverse)
    for d, i in enumerate(inverse):
        order[i] = d
    return flat.view([shape[d] for d in order]).permute(inverse)


def contiguous_strides(shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a row-major contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def dense_strides(x: torch.Tensor) -> tuple[int, ...] | None:
    """``x``'s strides when it is dense (no gaps, no overlap: contiguous in some dimension
    order), the layout a restore must give back; None for a strided slice, whose restored copy
    is contiguous as ``x.contiguous()`` would be."""
    if x.layout != torch.strided or x.numel() <= 1:
        return None
    if x.is_contiguous() or _permutation(x) is not None:
        return tuple(x.stride())
    return None


def dense_order(x: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``x`` from outermost to innermost in memory when it is dense (what
    :func:`strides_in_order` turns back into strides for any sizes); row-major order
    otherwise, as :func:`dense_strides`' None restores it. For a tensor of symbolic sizes,
    whose strides are expressions in them."""
    rowmajor = tuple(range(x.dim()))
    if x.layout != torch.strided or x.is_contiguous():
        return rowmajor
    return _permutation(x) or rowmajor


def strides_in_order(shape: torch.Size, order: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a dense tensor of ``shape`` whose dimensions lie in memory in
    ``order`` (outermost first)."""
    strides = [0] * len(shape)
    step: Any = 1
    for d in reversed(order):
        strides[d] = step
        step = step * max(shape[d], 1) if isinstance(shape[d], int) else step * shape[d]
    return tuple(strides)


def same_layout(x: torch.Tensor, strides: tuple[int, ...]) -> bool:
    """Whether ``x`` lies in memory as ``strides`` say (the stride of a size-1 dimension is
    never read, so it may differ)."""
    return all(n == 1 or s == want for n, s, want in zip(x.shape, x.stride(), strides))


def with_layout(x: torch.Tensor, strides: tuple[int, ...] | None) -> torch.Tensor:
    """``x`` laid out as ``strides`` (a copy when it is not). Backward kernels read a saved
    tensor with the strides it was saved with: cuDNN's BatchNorm backward, for one, rejects an
    input that is not contiguous in its own suggested memory format, and the CPU kernels
    choose their reduction order by layout."""
    if strides is None or same_layout(x, strides):
        return x
    out = torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device)
    return out.copy_(x)
