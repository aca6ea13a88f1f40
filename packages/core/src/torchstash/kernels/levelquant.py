"""Public codes of a table of levels: each value rounded stochastically to one of a few
sorted levels and bit-packed, in one pass (the derivative codes of GELU and SiLU round
f'(x) to the levels of f': torchstash-quant's ``derivs``).

Compiled kernels for the CPU and CUDA (one pass, nothing allocated but the codes); without
them the same steps run as PyTorch ops over the Philox and bit-packing kernels (the same
bits, with float32 temporaries of several times the input). The bit-exact definition is
:func:`level_quantize_ref`.
"""

from __future__ import annotations

import torch

from ._checks import as_int64, check_bits, check_u64
from ._dispatch import Impl, use_kernel
from .bitpack import pack_bits
from .groupquant import FLOAT_DTYPES
from .philox import philox_uniform
from .reference import pack_bits_ref, philox_uniform_ref

__all__ = ["level_quantize", "level_quantize_ref"]


def _check(x: object, levels: object, bits: int, seed: int, *, op: str) -> None:
    check_bits(bits, op=op)
    if bits < 2:
        raise ValueError(f"{op}: bits must be 2, 4 or 8 (one code is NaN's), got {bits}")
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{op}: x must be a float32, float16 or bfloat16 tensor, got {got}")
    if not isinstance(levels, torch.Tensor) or levels.dtype != torch.float32 or levels.dim() != 1:
        got = (
            f"{levels.dtype} {tuple(levels.shape)}" if isinstance(levels, torch.Tensor) else levels
        )
        raise TypeError(f"{op}: levels must be a 1-D float32 tensor, got {got}")
    if not 2 <= levels.numel() < 2**bits:
        raise ValueError(
            f"{op}: levels must hold 2 to {2**bits - 1} values at {bits} bits (one code is "
            f"NaN's), got {levels.numel()}"
        )
    if levels.device != x.device:
        raise ValueError(
            f"{op}: levels are on {levels.device} but x is on {x.device}; keep them on one device"
        )
    check_u64(seed, "seed", op=op)


def _composed(
    x: torch.Tensor, levels: torch.Tensor, bits: int, seed: int, *, golden: bool
) -> torch.Tensor:
    """The definition's steps as PyTorch ops, over the pure-PyTorch Philox and packing
    (``golden``) or over their kernels (the same bits)."""
    v = x.detach().contiguous().reshape(-1).float()
    upper = torch.bucketize(v, levels, out_int32=True).clamp_(1, levels.numel() - 1)
    low, high = levels[upper - 1], levels[upper]
    if golden:
        u = philox_uniform_ref(v.numel(), seed, 0, device=v.device)
    else:
        u = philox_uniform(v.numel(), seed, 0, device=v.device)
    codes = upper - (u * (high - low) >= v - low).to(torch.int32)
    codes = codes.masked_fill_(v.isnan(), 2**bits - 1).to(torch.uint8)
    return pack_bits_ref(codes, bits) if golden else pack_bits(codes, bits)


def level_quantize_ref(x: torch.Tensor, levels: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """The definition: element ``v`` of ``x`` (``x.contiguous()`` order, as float32) gets
    ``upper - (u * (high - low) >= v - low)``, where ``upper`` is the number of levels below
    ``v`` clamped to [1, L - 1], ``low``/``high`` the levels at ``upper - 1``/``upper`` and
    ``u`` its Philox uniform at (``seed``, 0); NaN gets ``2**bits - 1``; the codes are packed
    at ``bits`` bits."""
    _check(x, levels, bits, seed, op="level_quantize_ref")
    return _composed(x, levels, bits, seed, golden=True)


def level_quantize(
    x: torch.Tensor, levels: torch.Tensor, bits: int, *, seed: int, impl: Impl = "auto"
) -> torch.Tensor:
    """1-D uint8 of ``ceil(numel * bits / 8)`` bytes: float ``x`` (any shape and strides;
    ``x.contiguous()`` order) rounded stochastically to ``levels`` (1-D float32, ascending,
    2 to ``2**bits - 1`` of them: the last code is NaN's) so that each value's expected level
    is the value itself within the levels' range. ``seed`` in [0, 2**64) picks the uniforms."""
    op = "level_quantize"
    _check(x, levels, bits, seed, op=op)
    if use_kernel(impl, x.device):
        out: torch.Tensor = torch.ops.torchstash.level_quantize(x, levels, bits, as_int64(seed))
        return out
    if impl == "ref":
        return level_quantize_ref(x, levels, bits, seed)
    return _composed(x, levels, bits, seed, golden=False)
