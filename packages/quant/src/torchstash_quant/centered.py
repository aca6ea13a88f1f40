"""Inputs of normalization ops coded relative to their own rows.

A normalization's backward reads its saved input through ``(x - mean) * rstd``: an error in
the input is multiplied by ``rstd``. A row with a large mean and a small spread (a Linear with
bias 100 before a LayerNorm) then loses everything to the codes' per-group offset (bfloat16,
8 significant bits: about 0.4 at 100) or to fp8's relative precision, and a constant row
(padding), whose normalized values are exactly 0 in stock, comes back as noise times
``1 / sqrt(eps)``. So each normalized row is coded after subtracting an offset stored as it
is (float32, one per row): its mean, which leaves the codes only the spread, or for a
constant row its value, which leaves exactly 0, marked as such and restored exactly whatever
the codec does with zeros.

The backward also reads the decoded row's mean against the exact saved one: under a gradient
that varies little along a row, ``xhat * mean(g * xhat)`` turns the row's mean error into the
result's (fp8's errors on a ReLU's rows, alike for every zero, took the input gradient's cosine
below a ReLU and a LayerNorm to 0.50; 0.94 with no offset at all). The centered values' mean
is 0, so decoding subtracts the decoded row's mean before adding the offset back: a
projection, which never makes a row's error larger, and leaves the row's mean exact. Rows
holding NaN or Inf have offset 0 and no such step, so those come back where they were.

A codec whose groups cannot follow the rows (Mesa's: one range per channel group, over all
rows; per-group codes where no group size divides the row, 257 wide) gives every row the
same absolute error, and a row with a small spread then gets a large one after ``rstd``
(rows whose scales differ threefold took a LayerNorm's input gradient cosine to 0.66 under
``quant.mesa``; a row of 1e28 beside rows of 1 made int8's gradients infinite). Such a codec
says ``scales_rows = True``, and where its groups cannot follow the rows each centered row
is divided by its largest finite magnitude, kept exactly (float32, one per row), so the
codes see rows of one scale.

Both directions are one kernel pass each (:func:`torchstash.kernels.row_center` and
:func:`~torchstash.kernels.row_uncenter`, bit-exact with their reference): the dozen PyTorch
passes they replace (a row ``aminmax`` alone took 0.54 ms on a 1 MB BatchNorm input, one
thread) cost more than the codes themselves. A row's offset is its mean summed in a fixed
float64 order, so the kernels and the reference agree bit for bit.
"""

from __future__ import annotations

import torch

from torchstash.kernels import row_center, row_uncenter

#: Rows shorter than this are kept exact: a row's offset and flag would cost about as much
#: as the codes, and such a row (``LayerNorm(1)``) normalizes to a constant anyway.
MIN_CENTERED_ROW = 32


def center_rows(
    x: torch.Tensor, run: int, scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` (float32, shaped like ``x``) minus each ``run``-element row's offset; the offsets
    (float32, one per row: the row's mean, a constant row's value, 0 where that is not
    finite), which rows are constant (packed bits) and, with ``scale``, each centered row's
    largest finite magnitude (1 where there is none: a constant row, or one of NaN/Inf only),
    which the returned rows are divided by (None without)."""
    centered, offsets, constant, scales = row_center(x, run, scale=scale)
    return centered.view(x.shape), offsets, constant, scales


def uncenter(
    decoded: torch.Tensor,
    offsets: torch.Tensor,
    constant: torch.Tensor,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``x`` back from its decoded centered values (float32): each row multiplied by its scale
    (if any), constant rows zeroed, the row's decoded mean (finite) taken off, its offset added."""
    run = decoded.numel() // max(offsets.numel(), 1)
    flat = row_uncenter(decoded.reshape(-1), offsets, constant, scales, run, dtype)
    return flat.view(decoded.shape)
