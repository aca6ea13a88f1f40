"""Public fused per-group stochastic quantization: the compiled kernel when it can run, else the reference.

A tensor saved for backward at ``bits`` bits per element plus two bfloat16 per group of
``group_size`` elements (``lo`` and a signed ``step``), with stochastic rounding so the
dequantized value is unbiased. One fused pass per group (min/max, then round and pack)
is what makes it cheap enough to run on every saved activation. The bit-exact definition
is :mod:`torchstash.kernels.groupquant_reference` (and csrc/README.md); the rounding
uniforms are ``philox_uniform(numel, seed, 0)``, so a seed reproduces the codes anywhere.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    as_int64,
    check_bits,
    check_flag,
    check_float_dtype,
    check_float_tensor,
    check_group_size,
    check_numel,
    check_packed,
    check_seed,
    check_tensor,
)
from ._dispatch import Impl, use_kernel
from .groupquant_reference import group_dequantize_ref, group_quantize_ref, group_steps, num_groups
from .reference import Seed

__all__ = ["FLOAT_DTYPES", "group_dequantize", "group_quantize", "group_steps"]


def _check_group_params(
    t: torch.Tensor, name: str, groups: int, packed: torch.Tensor, *, op: str
) -> None:
    check_tensor(t, name, op=op)
    if t.dtype != torch.bfloat16:
        raise TypeError(
            f"{op}: {name} must be bfloat16, got {t.dtype}; pass the tensors group_quantize returned"
        )
    if t.dim() != 1 or t.numel() != groups:
        raise ValueError(
            f"{op}: {name} must be 1-D with {groups} entries (one per group), got shape "
            f"{tuple(t.shape)}; pass the numel and group_size that were used to quantize"
        )
    if t.device != packed.device:
        raise ValueError(
            f"{op}: {name} is on {t.device} but packed is on {packed.device}; "
            "keep the three tensors on one device"
        )


def group_quantize(
    x: torch.Tensor,
    bits: int,
    group_size: int = 256,
    *,
    seed: Seed,
    stochastic: bool = True,
    impl: Impl = "auto",
    checked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, lo, step)`` for float ``x`` (any shape and strides; ``x.contiguous()`` order).

    ``packed``: 1-D uint8 of ``ceil(numel * bits / 8)`` bytes; ``lo``, ``step``: 1-D bfloat16
    of ``ceil(numel / group_size)`` entries, ``step`` negative for a group holding NaN/Inf.
    ``seed`` in [0, 2**64) picks the rounding uniforms; ``stochastic=False`` rounds to nearest.
    A 0-dim int64 tensor holding the seed's 64 bits (on the CPU or ``x``'s device) draws the
    same: a compiled graph's seed, an input or drawn in the graph, not a constant (the
    kernel's ``seeded`` overload reads it; on CUDA from device memory, with no host sync).
    ``checked=False`` leaves the arguments to the compiled op's own checks: for a codec that
    built them itself, once per saved tensor (the checks here cost it microseconds).
    """
    op = "group_quantize"
    if checked:
        check_bits(bits, op=op)
        check_group_size(group_size, op=op)
        check_float_tensor(x, "x", op=op)
        check_seed(seed, op=op, device=x.device)
        check_flag(stochastic, "stochastic", op=op)
    if use_kernel(impl, x.device):
        if isinstance(seed, torch.Tensor):
            packed, lo, step = torch.ops.torchstash.group_quantize.seeded(
                x, bits, group_size, seed, stochastic
            )
        else:
            packed, lo, step = torch.ops.torchstash.group_quantize(
                x, bits, group_size, as_int64(seed), stochastic
            )
        return packed, lo, step
    return group_quantize_ref(x, bits, group_size, seed, stochastic)


def group_dequantize(
    packed: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
    *,
    impl: Impl = "auto",
    checked: bool = True,
) -> torch.Tensor:
    """The 1-D ``dtype`` tensor of ``numel`` values that :func:`group_quantize` encoded.

    NaN and Inf come back where they were (at 1 bit every non-finite value is NaN).
    ``checked=False``: as for :func:`group_quantize`, for the codec that made the codes.
    """
    op = "group_dequantize"
    if checked:
        check_bits(bits, op=op)
        check_group_size(group_size, op=op)
        check_numel(numel, op=op)
        check_packed(packed, bits, numel, op=op)
        groups = num_groups(numel, group_size)
        _check_group_params(lo, "lo", groups, packed, op=op)
        _check_group_params(step, "step", groups, packed, op=op)
        check_float_dtype(dtype, "dtype", op=op)
    if use_kernel(impl, packed.device):  # the codes' hot path: no dispatch() frame
        out: torch.Tensor = torch.ops.torchstash.group_dequantize(
            packed, lo, step, bits, group_size, numel, dtype
        )
        return out
    return group_dequantize_ref(packed, lo, step, bits, group_size, numel, dtype)
