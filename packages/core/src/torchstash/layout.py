"""Memory order: compress a tensor's values in the order they lie in memory, restore its strides.

A transposed or channels_last tensor is dense, just not row-major: permuting it to its memory
order is a free view, so a compressor never needs a copy, and the restored tensor gets the
original strides back (channels_last stays channels_last).
"""

from __future__ import annotations

import torch


def memory_order(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
    """(view of ``x`` that is row-major contiguous, the permutation that undoes it) when
    ``x`` is a dense permutation of a contiguous tensor; else (``x.contiguous()``, None)."""
    if x.is_contiguous() or x.dim() < 2:
        return x.contiguous(), None
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.shape[d]))
    xp = x.permute(order)
    if not xp.is_contiguous():
        return x.contiguous(), None
    inverse = [0] * len(order)
    for i, d in enumerate(order):
        inverse[d] = i
    return xp, tuple(inverse)


def restore(flat: torch.Tensor, shape: torch.Size, inverse: tuple[int, ...] | None) -> torch.Tensor:
    """The tensor of ``shape`` whose values ``flat`` holds in the order :func:`memory_order` chose."""
    if inverse is None:
        return flat.view(shape)
    order = [0] * len(inverse)
    for d, i in enumerate(inverse):
        order[i] = d
    return flat.view([shape[d] for d in order]).permute(inverse)
