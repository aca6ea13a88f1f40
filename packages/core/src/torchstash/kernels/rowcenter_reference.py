"""Golden model of rows coded relative to their own offset (``row_center`` / ``row_uncenter``).

Bit-exact definition the CPU and CUDA kernels must reproduce (csrc/README.md repeats it).
The flat tensor (``x.contiguous()`` order, read as float32) is ``rows`` rows of ``run``:

* A row's sum: 16 float64 lanes, lane ``l`` adding ``x[l], x[l + 16], ...`` in order from
  ``+0.0`` (exact float32 -> float64 widening), then the lanes folded by halves
  (``s[l] + s[l + w]``, ``w = 8, 4, 2, 1``). Its mean: ``float32(sum / run)``. A fixed order
  in float64 instead of ``torch.mean``'s (which depends on the build's SIMD width), so a
  kernel can reproduce it, whatever its chunks, threads or warps.
* ``constant``: every element equal to the first, and that one finite (a NaN or Inf row is
  not constant); packed one bit per row (the bitpack layout).
* ``offset``: a constant row's first element ``+ 0.0`` (exact: its zeros restore exactly
  whatever the codec does with them), else its mean; 0 where that is not finite.
* ``centered = x - offset`` (float32); with ``scale``, then divided by the row's largest
  finite ``|centered|`` (``scales``, 1 where none is above 0), so a codec whose groups span
  rows sees rows of one range.
* ``row_group_quantize`` / ``row_group_dequantize``: ``group_quantize`` of the centered values
  (no scales) and ``row_uncenter`` of their float32 ``group_dequantize``, fused (the centered
  and the decoded values are never written).
* Restoring decoded centered values ``d`` (float32): ``v = d * scale`` (with scales), 0 on a
  constant row; ``drift`` = the mean of ``v`` as above (0 where not finite);
  ``v + (offset - drift)`` cast to the output dtype (round to nearest even). Taking the
  decoded row's own mean off keeps the row's mean exact (``torchstash_quant.centered``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .groupquant_reference import group_dequantize_ref, group_quantize_ref
from .reference import Seed, pack_bits_ref, unpack_bits_ref

__all__ = [
    "SUM_LANES",
    "row_center_ref",
    "row_group_dequantize_ref",
    "row_group_quantize_ref",
    "row_means_ref",
    "row_uncenter_ref",
]

#: float64 lanes of a row's sum.
SUM_LANES = 16


def row_means_ref(rows: torch.Tensor) -> torch.Tensor:
    """The float32 mean of each row of a 2-D tensor, summed as the module docstring says.

    ``cumsum`` over the lane-strided view adds each lane's elements one after the other in
    float64, from 0 (the sequential order is checked against a Python loop in the tests)."""
    count, run = rows.shape
    steps = -(-run // SUM_LANES)
    padded = F.pad(rows.double(), (0, steps * SUM_LANES - run))  # +0.0 changes no lane's sum
    lanes = padded.view(count, steps, SUM_LANES).cumsum(dim=1)[:, -1]
    width = SUM_LANES // 2
    while width >= 1:
        lanes = lanes[:, :width] + lanes[:, width : 2 * width]
        width //= 2
    return (lanes[:, 0] / run).float()


def _check_run(numel: int, run: int, op: str) -> int:
    if isinstance(run, bool) or not isinstance(run, int) or run < 1:
        raise ValueError(f"{op}: run must be an int >= 1 (the elements of a row), got {run!r}")
    if numel % run:
        raise ValueError(f"{op}: {numel} elements do not split into rows of {run}")
    return numel // run


def row_center_ref(
    x: torch.Tensor, run: int, scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(centered, offsets, constant, scales)``: float32 ``(numel,)``, float32 ``(rows,)``,
    packed uint8 ``(ceil(rows / 8),)`` and float32 ``(rows,)`` (``(0,)`` without ``scale``)."""
    count = _check_run(x.numel(), run, "row_center_ref")
    rows = x.contiguous().view(count, run).float()
    first = rows[:, 0]
    constant = (rows == first[:, None]).all(dim=1) & first.isfinite()
    offsets = torch.where(constant, first + 0.0, row_means_ref(rows))
    offsets = torch.where(offsets.isfinite(), offsets, 0.0)
    centered = rows - offsets[:, None]
    scales = centered.new_empty(0)
    if scale:
        scales = torch.where(centered.isfinite(), centered.abs(), 0.0).amax(dim=1)
        scales = torch.where(scales > 0, scales, 1.0)
        centered = centered / scales[:, None]
    return centered.reshape(-1), offsets, pack_bits_ref(constant, 1), scales


def row_uncenter_ref(
    decoded: torch.Tensor,
    offsets: torch.Tensor,
    constant: torch.Tensor,
    scales: torch.Tensor | None,
    run: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The ``(numel,)`` ``dtype`` values :func:`row_center_ref` centered, from their decoded
    centered values (float32) and what it returned (``scales`` None or empty: not scaled)."""
    count = _check_run(decoded.numel(), run, "row_uncenter_ref")
    rows = decoded.contiguous().view(count, run).float()
    if scales is not None and scales.numel():
        rows = rows * scales[:, None]
    flat = unpack_bits_ref(constant, 1, count).bool()
    rows = torch.where(flat[:, None], 0.0, rows)
    drift = row_means_ref(rows)
    drift = torch.where(drift.isfinite(), drift, 0.0)
    return (rows + (offsets.float() - drift)[:, None]).to(dtype).reshape(-1)


def row_group_quantize_ref(
    x: torch.Tensor, run: int, bits: int, group_size: int, seed: Seed, stochastic: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, lo, step, offsets, constant)``: :func:`row_center_ref` (no scales), then
    ``group_quantize`` of the centered values."""
    centered, offsets, constant, _ = row_center_ref(x, run)
    packed, lo, step = group_quantize_ref(centered, bits, group_size, seed, stochastic)
    return packed, lo, step, offsets, constant


def row_group_dequantize_ref(
    packed: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    offsets: torch.Tensor,
    constant: torch.Tensor,
    bits: int,
    group_size: int,
    run: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The 1-D ``dtype`` values :func:`row_group_quantize_ref` coded."""
    decoded = group_dequantize_ref(packed, lo, step, bits, group_size, numel, torch.float32)
    return row_uncenter_ref(decoded, offsets, constant, None, run, dtype)
