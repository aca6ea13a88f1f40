"""Sparse storage chosen by cost: a presence bitmap, 16-bit in-block offsets, or nothing.

For ``n`` elements of ``e`` bytes of which ``K`` are kept:

* bitmap: ``n / 8`` bytes of mask plus ``K * e`` of values;
* offsets: ``2 * K`` bytes of uint16 positions inside 65536-element blocks, 4 bytes of count
  per block, plus ``K * e``;
* dense: ``n * e``.

The bitmap wins while more than one element in 16 is kept, the offsets above that; DropIT's
int32 indices (``K * (e + 4)``) cost more than dense in fp16 below gamma of about 0.67, and
both forms here are below dense at every gamma above 1 / (8 e).
"""

from __future__ import annotations

from torchstash.kernels.sparse import OFFSET_BLOCK

BITMAP, OFFSETS, DENSE = "bitmap", "offsets", "dense"


def cost(form: str, numel: int, kept: int, itemsize: int) -> int:
    """Bytes of ``form`` for ``kept`` of ``numel`` elements of ``itemsize`` bytes."""
    if form == DENSE:
        return numel * itemsize
    if form == BITMAP:
        return (numel + 7) // 8 + kept * itemsize
    if form == OFFSETS:
        blocks = (numel + OFFSET_BLOCK - 1) // OFFSET_BLOCK
        return 2 * kept + 4 * blocks + kept * itemsize
    raise ValueError(f"unknown storage form {form!r}; known: {BITMAP}, {OFFSETS}, {DENSE}")


def cheapest(
    numel: int,
    kept: int,
    itemsize: int,
    forms: tuple[str, ...] = (BITMAP, OFFSETS),
    extra: int = 0,
) -> str:
    """The cheapest of ``forms``, or :data:`DENSE` when none, plus ``extra`` bytes stored
    beside it (fill values), is smaller than the tensor."""
    best = min(forms, key=lambda f: cost(f, numel, kept, itemsize))
    sparse = cost(best, numel, kept, itemsize) + extra
    return best if sparse < cost(DENSE, numel, kept, itemsize) else DENSE
