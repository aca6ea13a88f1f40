"""Argument checks shared by the references and the dispatchers.

Both paths raise the same Python exceptions with the same messages, whichever
implementation ends up running.
"""

from __future__ import annotations

import torch

BITS = (1, 2, 4, 8)
_U64 = 1 << 64


def check_bits(bits: int, *, op: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"{op}: bits={bits!r} is not supported; allowed values are 1, 2, 4, 8")
    return bits


def check_numel(numel: int, *, op: str) -> int:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{op}: numel must be an int >= 0, got {numel!r}")
    return numel


def check_codes(codes: torch.Tensor, bits: int, *, op: str) -> None:
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"{op}: codes must be a torch.Tensor, got {type(codes).__name__}")
    if codes.dtype not in (torch.uint8, torch.bool):
        raise TypeError(
            f"{op}: codes must be uint8 or bool, got {codes.dtype}; "
            "convert them with codes.to(torch.uint8)"
        )
    if codes.dtype == torch.bool and bits != 1:
        raise ValueError(
            f"{op}: bool codes are packed at bits=1, got bits={bits}; "
            "pass bits=1 or convert the codes with codes.to(torch.uint8)"
        )


def packed_size(numel: int, bits: int) -> int:
    """ceil(numel * bits / 8): the length of the packed form."""
    per = 8 // bits
    return (numel + per - 1) // per


def check_packed(packed: torch.Tensor, bits: int, numel: int, *, op: str) -> None:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{op}: packed must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.uint8:
        raise TypeError(
            f"{op}: packed must be uint8, got {packed.dtype}; pass the tensor pack_bits returned"
        )
    if packed.dim() != 1:
        raise ValueError(
            f"{op}: packed must be 1-D, got {packed.dim()} dims; "
            "pass the tensor pack_bits returned, or flatten it"
        )
    expected = packed_size(numel, bits)
    if packed.numel() != expected:
        raise ValueError(
            f"{op}: {numel} codes at {bits} bits need exactly {expected} packed bytes, "
            f"got {packed.numel()}; pass the numel and bits that were used to pack"
        )


def check_u64(value: int, name: str, *, op: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U64:
        raise ValueError(f"{op}: {name} must be an int in [0, 2**64), got {value!r}")
    return value


def as_int64(value: int) -> int:
    """The int64 with the same 64-bit pattern as ``value`` in [0, 2**64) (for op schemas)."""
    return value - _U64 if value >= 1 << 63 else value
