"""Inputs of normalization ops coded relative to their own rows.

A normalization's backward reads its saved input through ``(x - mean) * rstd``: an error in
the input is multiplied by ``rstd``. A row with a large mean and a small spread (a Linear with
bias 100 before a LayerNorm) then loses everything to the codes' per-group offset (bfloat16,
8 significant bits: about 0.4 at 100) or to fp8's relative precision, and a constant row
(padding), whose normalized values are exactly 0 in stock, comes back as noise times
``1 / sqrt(eps)``. So each normalized row is coded after subtracting its first element, kept
exactly: the codes hold only the spread, and a constant row is exactly 0, marked as such and
restored exactly whatever the codec does with zeros.

A codec whose groups cannot follow the rows (Mesa's: one range per channel group, over all
rows) gives every row the same absolute error, and a row with a small spread then gets a
large one after ``rstd`` (rows whose scales differ threefold took a LayerNorm's input
gradient cosine to 0.66 under ``quant.mesa``). Such a codec says ``scales_rows = True``, and
each centered row is divided by its largest finite magnitude, kept exactly (float32, one per
row), so the codes see rows of one scale.
"""

from __future__ import annotations

import torch

from torchstash.kernels import pack_mask, unpack_mask

#: Rows shorter than this are kept exact: a row's offset and flag would cost about as much
#: as the codes, and such a row (``LayerNorm(1)``) normalizes to a constant anyway.
MIN_CENTERED_ROW = 32


def center_rows(x: torch.Tensor, run: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` (float32, shaped like ``x``) minus each ``run``-element row's first element;
    the offsets (one per row, ``x``'s dtype, exact), and which rows are constant (packed
    bits)."""
    rows = x.reshape(-1, run)
    offsets = rows[:, 0].clone()  # a copy: a view would keep all of ``x`` alive
    centered = rows.float() - offsets.float()[:, None]
    constant = centered.abs().amax(dim=1) == 0  # NaN rows are not constant
    return centered.view(x.shape), offsets, pack_mask(constant)


def uncenter(
    decoded: torch.Tensor, offsets: torch.Tensor, constant: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``x`` back from its decoded centered values: the offsets added, constant rows exact."""
    shape = decoded.shape
    rows = decoded.reshape(offsets.numel(), -1).float()
    flat = unpack_mask(constant, offsets.numel())
    rows = torch.where(flat[:, None], 0.0, rows) + offsets.float()[:, None]
    return rows.to(dtype).view(shape)


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
