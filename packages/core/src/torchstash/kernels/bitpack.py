"""Public bit-packing entry points: the compiled kernel when it can run, else the reference.

Layout (csrc/README.md): code i lives in byte (i * bits) // 8 at bit shift
(i * bits) % 8; the packed form is 1-D uint8 of length ceil(numel * bits / 8).
"""

from __future__ import annotations

import torch

from ..errors import KernelUnavailable
from ._checks import check_bits, check_codes, check_numel, check_packed
from ._dispatch import Impl, dispatch, use_kernel
from .reference import (
    pack_bits_ref,
    sign_pack_ref,
    sign_select_ref,
    sign_unpack_ref,
    unpack_bits_ref,
)

__all__ = [
    "pack_bits",
    "pack_mask",
    "sign_pack",
    "sign_select",
    "sign_unpack",
    "unpack_bits",
    "unpack_mask",
]

#: What sign bits read and write (a ReLU's saved output, in any float type).
SIGN_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def pack_bits(codes: torch.Tensor, bits: int, *, impl: Impl = "auto") -> torch.Tensor:
    """Packs uint8 (or, at bits=1, bool) ``codes`` of any shape/strides into 1-D uint8.

    Only the low ``bits`` bits of each code are kept.
    """
    check_bits(bits, op="pack_bits")
    check_codes(codes, bits, op="pack_bits")
    return dispatch("pack_bits", impl, codes.device, pack_bits_ref, codes, bits)


def unpack_bits(
    packed: torch.Tensor, bits: int, numel: int, *, impl: Impl = "auto"
) -> torch.Tensor:
    """Unpacks ``numel`` uint8 codes (1-D) from what :func:`pack_bits` returned."""
    check_bits(bits, op="unpack_bits")
    check_numel(numel, op="unpack_bits")
    check_packed(packed, bits, numel, op="unpack_bits")
    return dispatch("unpack_bits", impl, packed.device, unpack_bits_ref, packed, bits, numel)


def pack_mask(mask: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """Packs a bool tensor at one bit per element (1-D uint8, ceil(numel / 8) bytes)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(
            f"pack_mask: mask must be a bool tensor, got {got}; use pack_bits for codes"
        )
    return pack_bits(mask, 1, impl=impl)


def unpack_mask(packed: torch.Tensor, numel: int, *, impl: Impl = "auto") -> torch.Tensor:
    """The 1-D bool mask of ``numel`` elements packed by :func:`pack_mask`."""
    codes = unpack_bits(packed, 1, numel, impl=impl)
    if torch.compiler.is_compiling():
        return codes != 0  # fuses; inductor cannot vectorize a uint8-to-bool bitcast
    return codes.view(torch.bool)


def sign_pack(x: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """Where float ``x`` (any shape; ``x.contiguous()`` order) is above zero or NaN, packed one
    bit per element (1-D uint8, ``ceil(numel / 8)`` bytes): ``pack_mask(~(x <= 0))`` in one
    pass, with no bool tensor in between."""
    if not isinstance(x, torch.Tensor) or x.dtype not in SIGN_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"sign_pack: x must be a float tensor, got {got}")
    return dispatch("sign_pack", impl, x.device, sign_pack_ref, x)


def sign_unpack(
    packed: torch.Tensor, numel: int, dtype: torch.dtype, *, impl: Impl = "auto"
) -> torch.Tensor:
    """1.0 where :func:`sign_pack`'s bit is set, else 0.0 (1-D ``dtype`` of ``numel``), in one
    pass."""
    check_numel(numel, op="sign_unpack")
    check_packed(packed, 1, numel, op="sign_unpack")
    if dtype not in SIGN_DTYPES:
        raise TypeError(f"sign_unpack: dtype must be a float dtype, got {dtype}")
    return dispatch("sign_unpack", impl, packed.device, sign_unpack_ref, packed, numel, dtype)


def sign_select(grad: torch.Tensor, packed: torch.Tensor, *, impl: Impl = "auto") -> torch.Tensor:
    """``grad`` where :func:`sign_pack`'s bit is set, else 0.0 (1-D, ``grad.contiguous()``
    order): a ReLU's ``threshold_backward`` read from its output's sign bits in one pass,
    bit for bit (NaN and -0.0 of the gradient pass where a bit is set)."""
    op = "sign_select"
    if not isinstance(grad, torch.Tensor) or grad.dtype not in SIGN_DTYPES:
        got = grad.dtype if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise TypeError(f"{op}: grad must be a float tensor, got {got}")
    check_packed(packed, 1, grad.numel(), op=op)
    if packed.device != grad.device:
        raise ValueError(
            f"{op}: packed is on {packed.device} but grad is on {grad.device}; keep them on "
            "one device"
        )
    if grad.device.type == "cpu" and use_kernel(impl, grad.device):
        out: torch.Tensor = torch.ops.torchstash.sign_select(grad, packed)
        return out
    if impl == "kernel":
        raise KernelUnavailable(
            f"{op}: its compiled kernel runs on the CPU only, grad is on {grad.device}; "
            "impl='auto' runs the same steps as PyTorch ops"
        )
    return sign_select_ref(grad, packed)
