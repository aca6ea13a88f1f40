"""Golden model of top-k selection by magnitude and sparse storage (``dropit.mink``'s layout).

Bit-exact definition the CPU and CUDA kernels must reproduce (csrc/README.md repeats it):

* The tensor is flattened in row-major order of ``x.contiguous()`` and read as ``(S, L)``
  segments (``S = segments``, ``L = numel / S``); ``k`` elements of each segment are kept,
  so exactly ``S * k`` in all, a count known before any data is read (no host sync).
* An element's *key* is its magnitude's bit pattern: float32 ``bits & 0x7FFFFFFF``, float16
  and bfloat16 ``bits & 0x7FFF``, as a non-negative integer; every NaN gets the greatest key
  (``0x7FFFFFFF`` / ``0x7FFF``), so NaN ranks above +-Inf and Inf above every finite value.
  The integer order of keys is the order of magnitudes. With ``exact=False`` a float32 key
  is cut to its top 16 bits (``key >> 16``: the magnitude to bfloat16 precision, two radix
  passes instead of four); 16-bit keys are always exact.
* ``topk_mask``: in each segment, the ``k`` elements with the greatest keys; among equal
  keys, the lower flat index first (a stable descending sort). The result is a 1-bit mask
  of the whole flat tensor packed as :func:`~torchstash.kernels.pack_mask` packs it (bit
  ``i % 8`` of byte ``i // 8``).
* ``mask_compact``: the masked elements' values, in flat order (1-D, ``x.dtype``).
* ``mask_scatter``: the dense 1-D tensor with those values back at the set bits, zero
  (``+0.0``) elsewhere.
* ``mask_offsets``: the same positions as 16-bit offsets inside blocks of
  :data:`OFFSET_BLOCK` elements (uint16, flat order) and the number of set bits in each
  block (int32, ``ceil(numel / OFFSET_BLOCK)`` of them); ``offsets_scatter`` is
  ``mask_scatter`` from that form.

This reference sorts and builds int64 indices; the kernels do neither (a radix select on
the keys, 256-bin histograms, then compaction by prefix counts).
"""

from __future__ import annotations

import torch

__all__ = [
    "OFFSET_BLOCK",
    "magnitude_keys",
    "mask_compact_ref",
    "mask_offsets_ref",
    "mask_scatter_ref",
    "offsets_scatter_ref",
    "topk_mask_ref",
]

#: Elements per block of 16-bit offsets.
OFFSET_BLOCK = 1 << 16


def magnitude_keys(x: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """int32 keys of ``x.contiguous()`` (flat) whose integer order is the magnitudes' order."""
    flat = x.contiguous().reshape(-1)
    if flat.dtype == torch.float32:
        key = flat.view(torch.int32) & 0x7FFFFFFF
        key = torch.where(key > 0x7F800000, torch.full_like(key, 0x7FFFFFFF), key)
        return key if exact else key >> 16
    key = flat.view(torch.int16).to(torch.int32) & 0x7FFF
    nan_above = 0x7C00 if flat.dtype == torch.float16 else 0x7F80
    return torch.where(key > nan_above, torch.full_like(key, 0x7FFF), key)


def _pack(mask: torch.Tensor) -> torch.Tensor:
    from .reference import pack_bits_ref

    return pack_bits_ref(mask, 1)


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    from .reference import unpack_bits_ref

    return unpack_bits_ref(packed, 1, numel).view(torch.bool)


def topk_mask_ref(x: torch.Tensor, segments: int, k: int, exact: bool = True) -> torch.Tensor:
    """The packed 1-bit mask of the ``k`` largest magnitudes in each of ``segments`` segments."""
    keys = magnitude_keys(x, exact)
    n = keys.numel()
    mask = torch.zeros(n, dtype=torch.bool, device=x.device)
    if n and k:
        rows = keys.view(segments, n // segments)
        order = rows.sort(dim=1, descending=True, stable=True).indices[:, :k]
        mask.view(segments, -1).scatter_(1, order, True)
    return _pack(mask)


def mask_compact_ref(x: torch.Tensor, packed: torch.Tensor, kept: int) -> torch.Tensor:
    """The ``kept`` values of ``x`` (flat order) under the packed mask."""
    flat = x.contiguous().reshape(-1)
    values = flat[_unpack(packed, flat.numel())]
    if values.numel() != kept:
        raise ValueError(f"mask_compact: the mask has {values.numel()} set bits, not {kept}")
    return values


def mask_scatter_ref(packed: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """Dense 1-D: ``values`` at the mask's set bits (flat order), zero elsewhere."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out[_unpack(packed, numel)] = values
    return out


def mask_offsets_ref(
    packed: torch.Tensor, numel: int, kept: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint16 offsets inside blocks of OFFSET_BLOCK, int32 set bits per block)."""
    mask = _unpack(packed, numel)
    where = mask.nonzero().view(-1)
    if where.numel() != kept:
        raise ValueError(f"mask_offsets: the mask has {where.numel()} set bits, not {kept}")
    blocks = (numel + OFFSET_BLOCK - 1) // OFFSET_BLOCK
    counts = torch.bincount(where // OFFSET_BLOCK, minlength=blocks).to(torch.int32)
    offsets = (where % OFFSET_BLOCK).to(torch.int32).to(torch.uint16)
    return offsets, counts


def offsets_scatter_ref(
    offsets: torch.Tensor, counts: torch.Tensor, values: torch.Tensor, numel: int
) -> torch.Tensor:
    """Dense 1-D: ``values`` at the positions the offsets and block counts give."""
    block = torch.repeat_interleave(
        torch.arange(counts.numel(), device=counts.device), counts.long()
    )
    where = block * OFFSET_BLOCK + offsets.to(torch.int32).long()
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    out[where] = values
    return out
