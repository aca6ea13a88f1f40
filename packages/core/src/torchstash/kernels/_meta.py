"""Fake (meta) kernels of the ``torchstash::`` ops, so ``torch.compile`` can trace them.

The C++ library names this module (``m.set_python_module``): torch imports it when it
needs a fake kernel, and torch requires the registrations to come from here.
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, traced_bits, traced_count, traced_dtype, traced_float

_registered = False


def _pack_bits_fake(codes: torch.Tensor, bits: int) -> torch.Tensor:
    traced_bits(bits)
    torch._check(
        codes.dtype in (torch.uint8, torch.bool),
        lambda: f"codes must be uint8 or bool, got {codes.dtype}",
    )
    per = 8 // bits
    return codes.new_empty(((codes.numel() + per - 1) // per,), dtype=torch.uint8)


def _unpack_bits_fake(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    traced_bits(bits)
    traced_dtype(packed, "packed", torch.uint8)
    return packed.new_empty((numel,))


def _philox_uniform_fake(out: torch.Tensor, seed: int, offset: int) -> None:
    traced_dtype(out, "out", torch.float32)


def _group_quantize_fake(
    x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    traced_bits(bits)
    traced_count(group_size, "group_size")
    traced_float(x.dtype, "x")
    n, per = x.numel(), 8 // bits
    groups = (n + group_size - 1) // group_size
    return (
        x.new_empty(((n + per - 1) // per,), dtype=torch.uint8),
        x.new_empty((groups,), dtype=torch.bfloat16),
        x.new_empty((groups,), dtype=torch.bfloat16),
    )


def _group_dequantize_fake(
    packed: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    traced_bits(bits)
    traced_dtype(packed, "packed", torch.uint8)
    traced_float(dtype, "dtype")
    return packed.new_empty((numel,), dtype=dtype)


def _channel_minmax_fake(
    x: torch.Tensor, inner: int, channels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    traced_float(x.dtype, "x")
    traced_count(inner, "inner")
    traced_count(channels, "channels")
    return (
        x.new_empty((channels,), dtype=torch.float32),
        x.new_empty((channels,), dtype=torch.float32),
    )


def _channel_quantize_fake(
    x: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, inner: int, seed: int, stochastic: bool
) -> torch.Tensor:
    traced_float(x.dtype, "x")
    traced_dtype(lo, "lo", torch.float32)
    traced_dtype(step, "step", torch.float32)
    traced_count(inner, "inner")
    return x.new_empty((x.numel(),), dtype=torch.uint8)


def _channel_dequantize_fake(
    codes: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, inner: int, dtype: torch.dtype
) -> torch.Tensor:
    traced_dtype(codes, "codes", torch.uint8)
    traced_dtype(lo, "lo", torch.float32)
    traced_dtype(step, "step", torch.float32)
    traced_count(inner, "inner")
    traced_float(dtype, "dtype")
    return codes.new_empty((codes.numel(),), dtype=dtype)


def _row_center_fake(
    x: torch.Tensor, run: int, scale: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    traced_float(x.dtype, "x")
    traced_count(run, "run")
    rows = x.numel() // run
    return (
        x.new_empty((x.numel(),), dtype=torch.float32),
        x.new_empty((rows,), dtype=torch.float32),
        x.new_empty(((rows + 7) // 8,), dtype=torch.uint8),
        x.new_empty((rows if scale else 0,), dtype=torch.float32),
    )


def _row_uncenter_fake(
    decoded: torch.Tensor,
    offsets: torch.Tensor,
    constant: torch.Tensor,
    scales: torch.Tensor,
    run: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    traced_dtype(decoded, "decoded", torch.float32)
    traced_count(run, "run")
    traced_float(dtype, "dtype")
    return decoded.new_empty((decoded.numel(),), dtype=dtype)


def _row_group_quantize_fake(
    x: torch.Tensor, run: int, bits: int, group_size: int, seed: int, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    traced_count(run, "run")
    packed, lo, step = _group_quantize_fake(x, bits, group_size, seed, stochastic)
    rows = x.numel() // run
    return (
        packed,
        lo,
        step,
        x.new_empty((rows,), dtype=torch.float32),
        x.new_empty(((rows + 7) // 8,), dtype=torch.uint8),
    )


def _row_group_dequantize_fake(
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
    traced_count(run, "run")
    return _group_dequantize_fake(packed, lo, step, bits, group_size, numel, dtype)


def _fp8_quantize_fake(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    traced_float(x.dtype, "x")
    traced_count(group_size, "group_size")
    groups = (x.numel() + group_size - 1) // group_size
    return (
        x.new_empty((groups * group_size,), dtype=torch.uint8),
        x.new_empty((groups,), dtype=torch.bfloat16),
    )


def _fp8_dequantize_fake(
    codes: torch.Tensor, scale: torch.Tensor, group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    traced_dtype(codes, "codes", torch.uint8)
    traced_dtype(scale, "scale", torch.bfloat16)
    traced_float(dtype, "dtype")
    return codes.new_empty((numel,), dtype=dtype)


def _level_quantize_fake(
    x: torch.Tensor, levels: torch.Tensor, bits: int, seed: int
) -> torch.Tensor:
    traced_float(x.dtype, "x")
    torch._check(bits in (2, 4, 8), lambda: f"bits must be 2, 4 or 8, got {bits}")
    traced_dtype(levels, "levels", torch.float32)
    return x.new_empty(((x.numel() * bits + 7) // 8,), dtype=torch.uint8)


_SIGN_FLOATS = (*FLOAT_DTYPES, torch.float64)


def _sign_pack_fake(x: torch.Tensor) -> torch.Tensor:
    torch._check(x.dtype in _SIGN_FLOATS, lambda: f"x must be a float tensor, got {x.dtype}")
    return x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


def _sign_unpack_fake(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    traced_dtype(packed, "packed", torch.uint8)
    torch._check(dtype in _SIGN_FLOATS, lambda: f"dtype must be a float dtype, got {dtype}")
    return packed.new_empty((numel,), dtype=dtype)


def _sign_select_fake(grad: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    torch._check(
        grad.dtype in _SIGN_FLOATS, lambda: f"grad must be a float tensor, got {grad.dtype}"
    )
    traced_dtype(packed, "packed", torch.uint8)
    torch._check(
        packed.numel() == (grad.numel() + 7) // 8,
        lambda: f"packed must hold {(grad.numel() + 7) // 8} bytes, got {packed.numel()}",
    )
    return grad.new_empty((grad.numel(),))


_OFFSET_BLOCK = 1 << 16


def _check_kept(kept: int) -> None:
    traced_count(kept, "kept", 0)


def _check_mask(mask: torch.Tensor, numel: int) -> None:
    torch._check(mask.dtype == torch.uint8, lambda: f"the mask must be uint8, got {mask.dtype}")
    traced_count(numel, "numel", 0)
    torch._check(
        mask.numel() == (numel + 7) // 8,
        lambda: f"{numel} elements need a mask of {(numel + 7) // 8} bytes, got {mask.numel()}",
    )


def _topk_mask_fake(x: torch.Tensor, segments: int, k: int, exact: bool) -> torch.Tensor:
    traced_float(x.dtype, "x")
    traced_count(segments, "segments")
    traced_count(k, "k", 0)
    return x.new_empty(((x.numel() + 7) // 8,), dtype=torch.uint8)


def _mask_compact_fake(x: torch.Tensor, mask: torch.Tensor, kept: int) -> torch.Tensor:
    traced_float(x.dtype, "x")
    _check_mask(mask, x.numel())
    _check_kept(kept)
    return x.new_empty((kept,))


def _mask_scatter_fake(mask: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    _check_mask(mask, numel)
    traced_float(values.dtype, "values")
    return values.new_empty((numel,))


def _mask_offsets_fake(
    mask: torch.Tensor, numel: int, kept: int
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_mask(mask, numel)
    _check_kept(kept)
    blocks = (numel + _OFFSET_BLOCK - 1) // _OFFSET_BLOCK
    return (
        mask.new_empty((kept,), dtype=torch.uint16),
        mask.new_empty((blocks,), dtype=torch.int32),
    )


def _offsets_scatter_fake(
    offsets: torch.Tensor, counts: torch.Tensor, values: torch.Tensor, numel: int
) -> torch.Tensor:
    traced_dtype(offsets, "offsets", torch.uint16)
    traced_dtype(counts, "counts", torch.int32)
    traced_float(values.dtype, "values")
    traced_count(numel, "numel", 0)
    return values.new_empty((numel,))


def _op_defined(name: str) -> bool:
    try:
        getattr(torch.ops.torchstash, name).default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def _ops_defined() -> bool:
    return _op_defined("pack_bits")


#: The op names of the fake kernels :func:`register` gives torch (``_<name>_fake`` each)
FAKES = (
    "pack_bits", "unpack_bits", "philox_uniform", "group_quantize", "group_dequantize",
    "channel_minmax", "channel_quantize", "channel_dequantize", "row_center", "row_uncenter",
    "row_group_quantize", "row_group_dequantize", "fp8_quantize", "fp8_dequantize", "sign_pack",
    "sign_unpack", "sign_select", "level_quantize", "topk_mask", "mask_compact", "mask_scatter",
    "mask_offsets", "offsets_scatter",
)  # fmt: skip


def register() -> None:
    """Registers the fake kernels once per process (the ops must already be defined; a
    library built from older sources, ``TORCHSTASH_CSRC_DIR``, may lack the newer ones)."""
    global _registered
    if _registered:
        return
    for name in FAKES:
        if _op_defined(name):
            torch.library.register_fake(f"torchstash::{name}", globals()[f"_{name}_fake"])
    _registered = True


if _ops_defined():  # imported by torch itself, after the library was loaded elsewhere
    register()
