"""Public top-k selection by magnitude and sparse storage: the compiled kernel when it can run, else the reference.

``dropit.mink`` keeps the ``k`` largest magnitudes of each segment of a saved tensor, as a
1-bit mask plus the kept values, or as 16-bit in-block offsets plus the values. The kernels
find each segment's threshold by a radix select on the magnitudes' bit patterns (256-bin
histograms, two or four passes) and compact by prefix counts, with no sort and no int64
index temporaries. The bit-exact definition is :mod:`torchstash.kernels.sparse_reference`.
"""

from __future__ import annotations

import torch

from ._checks import check_count, check_flag, check_float_tensor, check_numel, check_packed
from ._dispatch import Impl, dispatch
from .sparse_reference import (
    OFFSET_BLOCK,
    mask_compact_ref,
    mask_offsets_ref,
    mask_scatter_ref,
    offsets_scatter_ref,
    topk_mask_ref,
)

__all__ = [
    "OFFSET_BLOCK",
    "mask_compact",
    "mask_offsets",
    "mask_scatter",
    "offsets_scatter",
    "topk_mask",
]


def _check_segments(numel: int, segments: int, k: int, *, op: str) -> None:
    if numel % segments:
        raise ValueError(
            f"{op}: {numel} elements do not split into {segments} equal segments; "
            "pass a segment count that divides the number of elements"
        )
    if numel and k > numel // segments:
        raise ValueError(f"{op}: k={k} is more than a segment's {numel // segments} elements")


def _check_mask(packed: object, numel: int, *, op: str) -> torch.Tensor:
    check_packed(packed, 1, numel, op=op)
    assert isinstance(packed, torch.Tensor)
    return packed


def _check_same_device(a: torch.Tensor, b: torch.Tensor, names: str, *, op: str) -> None:
    if a.device != b.device:
        raise ValueError(f"{op}: {names} are on {a.device} and {b.device}; keep them on one device")


def topk_mask(
    x: torch.Tensor, segments: int, k: int, *, exact: bool = True, impl: Impl = "auto"
) -> torch.Tensor:
    """The packed 1-bit mask (uint8, ``ceil(numel / 8)`` bytes) of the ``k`` largest
    magnitudes in each of ``segments`` equal segments of ``x.contiguous()`` (flat order).

    NaN ranks above Inf, Inf above every finite value; equal magnitudes go to the lower
    index. ``exact=False`` ranks float32 magnitudes at bfloat16 precision (two radix passes
    instead of four); float16 and bfloat16 are always exact.
    """
    op = "topk_mask"
    x = check_float_tensor(x, "x", op=op)
    check_count(segments, "segments", op=op, low=1)
    check_count(k, "k", op=op, low=0)
    _check_segments(x.numel(), segments, k, op=op)
    check_flag(exact, "exact", op=op)
    return dispatch("topk_mask", impl, x.device, topk_mask_ref, x, segments, k, exact)


def mask_compact(
    x: torch.Tensor, packed: torch.Tensor, kept: int, *, impl: Impl = "auto"
) -> torch.Tensor:
    """The ``kept`` values of ``x.contiguous()`` (flat order) whose mask bit is set (1-D)."""
    op = "mask_compact"
    x = check_float_tensor(x, "x", op=op)
    packed = _check_mask(packed, x.numel(), op=op)
    _check_same_device(x, packed, "x and the mask", op=op)
    check_count(kept, "kept", op=op, low=0)
    return dispatch("mask_compact", impl, x.device, mask_compact_ref, x, packed, kept)


def mask_scatter(
    packed: torch.Tensor, values: torch.Tensor, numel: int, *, impl: Impl = "auto"
) -> torch.Tensor:
    """Dense 1-D tensor of ``numel`` elements: ``values`` at the set bits, zero elsewhere."""
    op = "mask_scatter"
    check_numel(numel, op=op)
    packed = _check_mask(packed, numel, op=op)
    values = check_float_tensor(values, "values", op=op)
    _check_same_device(values, packed, "values and the mask", op=op)
    if values.dim() != 1:
        raise ValueError(f"{op}: values must be 1-D, got shape {tuple(values.shape)}")
    return dispatch("mask_scatter", impl, values.device, mask_scatter_ref, packed, values, numel)


def mask_offsets(
    packed: torch.Tensor, numel: int, kept: int, *, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask's set bits as uint16 offsets inside blocks of :data:`OFFSET_BLOCK` elements
    (flat order), and the int32 count of set bits per block."""
    op = "mask_offsets"
    check_numel(numel, op=op)
    packed = _check_mask(packed, numel, op=op)
    check_count(kept, "kept", op=op, low=0)
    return dispatch("mask_offsets", impl, packed.device, mask_offsets_ref, packed, numel, kept)


def offsets_scatter(
    offsets: torch.Tensor,
    counts: torch.Tensor,
    values: torch.Tensor,
    numel: int,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """Dense 1-D tensor of ``numel`` elements from :func:`mask_offsets`' form and the values."""
    op = "offsets_scatter"
    check_numel(numel, op=op)
    values = check_float_tensor(values, "values", op=op)
    blocks = (numel + OFFSET_BLOCK - 1) // OFFSET_BLOCK
    if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.uint16 or offsets.dim() != 1:
        raise TypeError(f"{op}: offsets must be 1-D uint16, as mask_offsets returns them")
    if (
        not isinstance(counts, torch.Tensor)
        or counts.dtype != torch.int32
        or counts.shape != (blocks,)
    ):
        raise TypeError(
            f"{op}: counts must be int32 of shape ({blocks},) for {numel} elements, "
            "as mask_offsets returns them"
        )
    if offsets.numel() != values.numel() or values.dim() != 1:
        raise ValueError(
            f"{op}: {offsets.numel()} offsets need as many 1-D values, got shape {tuple(values.shape)}"
        )
    for t, name in ((offsets, "offsets"), (counts, "counts")):
        _check_same_device(values, t, f"values and {name}", op=op)
    args = (offsets, counts, values, numel)
    return dispatch("offsets_scatter", impl, values.device, offsets_scatter_ref, *args)
