"""Mesa's ``packbit``: small integers packed several to a byte along one dimension.

``mask`` gives the width (``0b1``: 1 bit, ``0b11``: 2, ``0b1111``: 4, ``0b11111111``: 8);
the first element goes to the most significant bits, as Mesa (and NumPy) pack. Despite the
names nothing is padded: the size along ``dim`` must divide by the elements per byte.
"""

from __future__ import annotations

import torch

WIDTHS = {0b1: 1, 0b11: 2, 0b1111: 4, 0b11111111: 8}


def _layout(tensor: torch.Tensor, dim: int, mask: int, name: str) -> tuple[int, int, torch.Tensor]:
    if mask not in WIDTHS:
        raise ValueError(f"{name}: mask={mask:#b} must be 0b1, 0b11, 0b1111 or 0b11111111")
    bits = WIDTHS[mask]
    per_byte = 8 // bits
    dim = dim % tensor.dim()
    shifts = torch.arange(8 - bits, -1, -bits, device=tensor.device, dtype=torch.uint8)
    return dim, per_byte, shifts


def packbits_padded(
    tensor: torch.Tensor,
    dim: int = -1,
    mask: int = 0b1,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.uint8,
) -> torch.Tensor:
    """``tensor`` (integers or bools that fit in the width) packed along ``dim``."""
    dim, per_byte, shifts = _layout(tensor, dim, mask, "packbits_padded")
    size = tensor.shape[dim]
    if size % per_byte:
        raise ValueError(
            f"packbits_padded: size {size} along dim {dim} does not divide by {per_byte} "
            "(elements per byte)"
        )
    shape = list(tensor.shape)
    shape[dim : dim + 1] = [size // per_byte, per_byte]
    grouped = tensor.to(torch.uint8).bitwise_and(mask).reshape(shape)
    view = [1] * grouped.dim()
    view[dim + 1] = per_byte
    packed = (grouped << shifts.view(view)).sum(dim + 1, dtype=torch.uint8).to(dtype)
    if out is not None:
        out.copy_(packed)
        return out
    return packed


def unpackbits_padded(
    tensor: torch.Tensor, dim: int = -1, mask: int = 0b1, out: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`packbits_padded` undone: ``uint8`` values of 0 to ``mask``, ``dim`` grown by
    the elements per byte."""
    dim, per_byte, shifts = _layout(tensor, dim, mask, "unpackbits_padded")
    view = [1] * (tensor.dim() + 1)
    view[dim + 1] = per_byte
    values = (tensor.to(torch.uint8).unsqueeze(dim + 1) >> shifts.view(view)) & mask
    shape = list(tensor.shape)
    shape[dim] *= per_byte
    values = values.reshape(shape)
    if out is not None:
        out.copy_(values)
        return out
    return values


__all__ = ["packbits_padded", "unpackbits_padded"]
