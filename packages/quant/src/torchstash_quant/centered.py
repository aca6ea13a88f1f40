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
"""

from __future__ import annotations

import torch

from torchstash.kernels import pack_mask, unpack_mask

#: Rows shorter than this are kept exact: a row's offset and flag would cost about as much
#: as the codes, and such a row (``LayerNorm(1)``) normalizes to a constant anyway.
MIN_CENTERED_ROW = 32


def center_rows(x: torch.Tensor, run: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (float32, shaped like ``x``) minus each ``run``-element row's offset; the offsets
    (float32, one per row: the row's mean, a constant row's value, 0 where that is not
    finite) and which rows are constant (packed bits)."""
    rows = x.reshape(-1, run).float()
    low, high = rows.aminmax(dim=1)
    constant = high - low == 0  # NaN and Inf rows are not constant
    offsets = torch.where(constant, low, rows.mean(dim=1))
    offsets = torch.where(offsets.isfinite(), offsets, 0.0)
    return (rows - offsets[:, None]).view(x.shape), offsets, pack_mask(constant)


def uncenter(
    decoded: torch.Tensor, offsets: torch.Tensor, constant: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``x`` back from its decoded centered values: each row's decoded mean (finite) taken
    off, its offset added, constant rows exact."""
    shape = decoded.shape
    rows = decoded.reshape(offsets.numel(), -1).float()
    flat = unpack_mask(constant, offsets.numel())
    rows = torch.where(flat[:, None], 0.0, rows)
    drift = rows.mean(dim=1)
    drift = torch.where(drift.isfinite(), drift, 0.0)
    return (rows + (offsets.float() - drift)[:, None]).to(dtype).view(shape)


def scale_rows(centered: torch.Tensor, run: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``centered`` with each ``run``-element row divided by its largest finite magnitude
    (1 where there is none: a constant row, or one of NaN/Inf only), and those scales."""
    rows = centered.reshape(-1, run)
    finite = torch.where(rows.isfinite(), rows.abs(), 0.0)
    scales = finite.amax(dim=1)
    scales = torch.where(scales > 0, scales, 1.0)
    return (rows / scales[:, None]).view(centered.shape), scales


def unscale_rows(decoded: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """:func:`scale_rows` undone on the decoded values (float32)."""
    rows = decoded.reshape(scales.numel(), -1).float()
    return (rows * scales[:, None]).view(decoded.shape)
