"""Public e4m3 codes with a per-group scale (``quant.fp8``): the compiled kernel when it can
run, else the reference.

One byte per element, a float code (e4m3) whose scale per group of ``group_size`` maps the
group's largest finite magnitude to 448; NaN and Inf keep reserved codes. One pass each way
instead of a dozen full-size PyTorch passes. The bit-exact definition is
:mod:`torchstash.kernels.fp8_reference` (and csrc/README.md).
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, check_float_tensor, check_group_size
from ._dispatch import Impl, dispatch
from .fp8_reference import fp8_dequantize_ref, fp8_quantize_ref

__all__ = ["fp8_dequantize", "fp8_quantize"]


def fp8_quantize(
    x: torch.Tensor, group_size: int = 256, *, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` for float ``x`` (any shape and strides; ``x.contiguous()`` order):
    uint8 codes of whole groups (``ceil(numel / group_size) * group_size``, the padding coded
    as 0) and the bfloat16 scale of each group, negative for one holding NaN/Inf."""
    op = "fp8_quantize"
    check_group_size(group_size, op=op)
    check_float_tensor(x, "x", op=op)
    return dispatch("fp8_quantize", impl, x.device, fp8_quantize_ref, x, group_size)


def fp8_dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """The 1-D ``dtype`` tensor of the ``numel`` values :func:`fp8_quantize` coded, from its
    first ``numel`` codes."""
    op = "fp8_dequantize"
    check_group_size(group_size, op=op)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.shape != (numel,):
        got = f"{codes.dtype} {tuple(codes.shape)}" if isinstance(codes, torch.Tensor) else codes
        raise ValueError(f"{op}: codes must be 1-D uint8 of {numel} codes, got {got}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: dtype must be float32, float16 or bfloat16, got {dtype}")
    args = (codes, scale, group_size, numel, dtype)
    return dispatch("fp8_dequantize", impl, codes.device, fp8_dequantize_ref, *args)
