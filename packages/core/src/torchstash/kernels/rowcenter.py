"""Public rows-centered-on-an-offset ops: the compiled kernel when it can run, else the reference.

What ``torchstash_quant.centered`` does to a normalization's input before any code sees it
(each row's offset taken off, and optionally its range divided out), and undoes after: one
pass each way instead of a dozen full-size PyTorch passes. ``row_group_quantize`` /
``row_group_dequantize`` fuse the centering with ``group_quantize`` / ``group_dequantize``
(one call each way, the centered values never written). The bit-exact definition is
:mod:`torchstash.kernels.rowcenter_reference` (and csrc/README.md).
"""

from __future__ import annotations

import torch

from ._checks import (
    as_int64,
    check_bits,
    check_float_dtype,
    check_float_tensor,
    check_seed,
    check_tensor,
)
from ._dispatch import Impl, use_kernel
from .reference import Seed
from .rowcenter_reference import (
    row_center_ref,
    row_group_dequantize_ref,
    row_group_quantize_ref,
    row_uncenter_ref,
)

__all__ = ["row_center", "row_group_dequantize", "row_group_quantize", "row_uncenter"]


def row_center(
    x: torch.Tensor, run: int, *, scale: bool = False, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(centered, offsets, constant, scales)`` for float ``x`` (any shape and strides,
    ``x.contiguous()`` order) in rows of ``run``: the centered values (float32, 1-D), each
    row's offset (float32), which rows are constant (packed bits) and, with ``scale``, the
    rows' scales (float32; None without)."""
    op = "row_center"
    check_float_tensor(x, "x", op=op)
    if use_kernel(impl, x.device):
        out = torch.ops.torchstash.row_center(x, run, scale)
    else:
        out = row_center_ref(x, run, scale)
    centered, offsets, constant, scales = out
    return centered, offsets, constant, scales if scale else None


def row_uncenter(
    decoded: torch.Tensor,
    offsets: torch.Tensor,
    constant: torch.Tensor,
    scales: torch.Tensor | None,
    run: int,
    dtype: torch.dtype,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """The 1-D ``dtype`` values :func:`row_center` centered, from their decoded centered
    values (float32) and what it returned."""
    op = "row_uncenter"
    if check_tensor(decoded, "decoded", op=op).dtype != torch.float32:
        raise TypeError(f"{op}: decoded must be float32, got {decoded.dtype}")
    check_float_dtype(dtype, "dtype", op=op)
    if use_kernel(impl, decoded.device):
        empty = offsets.new_empty(0) if scales is None else scales
        out: torch.Tensor = torch.ops.torchstash.row_uncenter(
            decoded, offsets, constant, empty, run, dtype
        )
        return out
    return row_uncenter_ref(decoded, offsets, constant, scales, run, dtype)


def row_group_quantize(
    x: torch.Tensor,
    run: int,
    bits: int,
    group_size: int = 256,
    *,
    seed: Seed,
    stochastic: bool = True,
    impl: Impl = "auto",
    checked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, lo, step, offsets, constant)``: :func:`group_quantize` of
    :func:`row_center`'s centered values (no scales), in one pass (``checked``: as there).
    A seed tensor (a compiled graph's: see :func:`~.groupquant.group_quantize`) goes to the
    kernel's ``seeded`` overload."""
    op = "row_group_quantize"
    if checked:
        check_float_tensor(x, "x", op=op)
        check_bits(bits, op=op)
        check_seed(seed, op=op, device=x.device)
    if use_kernel(impl, x.device):
        if isinstance(seed, torch.Tensor):
            out = torch.ops.torchstash.row_group_quantize.seeded(
                x, run, bits, group_size, seed, stochastic
            )
        else:
            out = torch.ops.torchstash.row_group_quantize(
                x, run, bits, group_size, as_int64(seed), stochastic
            )
        packed, lo, step, offsets, constant = out
        return packed, lo, step, offsets, constant
    return row_group_quantize_ref(x, run, bits, group_size, seed, stochastic)


def row_group_dequantize(
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
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """The 1-D ``dtype`` values :func:`row_group_quantize` coded, in one pass."""
    op = "row_group_dequantize"
    check_bits(bits, op=op)
    check_float_dtype(dtype, "dtype", op=op)
    if use_kernel(impl, packed.device):  # the codes' hot path: no dispatch() frame
        out: torch.Tensor = torch.ops.torchstash.row_group_dequantize(
            packed, lo, step, offsets, constant, bits, group_size, run, numel, dtype
        )
        return out
    return row_group_dequantize_ref(
        packed, lo, step, offsets, constant, bits, group_size, run, numel, dtype
    )
