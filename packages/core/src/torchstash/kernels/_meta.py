"""Fake (meta) kernels of the ``torchstash::`` ops, so ``torch.compile`` can trace them.

The C++ library names this module (``m.set_python_module``): torch imports it when it
needs a fake kernel, and torch requires the registrations to come from here.
"""

from __future__ import annotations

import torch

_registered = False


def _pack_bits_fake(codes: torch.Tensor, bits: int) -> torch.Tensor:
    torch._check(bits in (1, 2, 4, 8), lambda: f"bits must be one of 1, 2, 4, 8, got {bits}")
    torch._check(
        codes.dtype in (torch.uint8, torch.bool),
        lambda: f"codes must be uint8 or bool, got {codes.dtype}",
    )
    per = 8 // bits
    return codes.new_empty(((codes.numel() + per - 1) // per,), dtype=torch.uint8)


def _unpack_bits_fake(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    torch._check(bits in (1, 2, 4, 8), lambda: f"bits must be one of 1, 2, 4, 8, got {bits}")
    torch._check(packed.dtype == torch.uint8, lambda: f"packed must be uint8, got {packed.dtype}")
    return packed.new_empty((numel,))


def _philox_uniform_fake(out: torch.Tensor, seed: int, offset: int) -> None:
    torch._check(out.dtype == torch.float32, lambda: f"out must be float32, got {out.dtype}")


def _ops_defined() -> bool:
    try:
        torch.ops.torchstash.pack_bits.default  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def register() -> None:
    """Registers the fake kernels once per process (the ops must already be defined)."""
    global _registered
    if _registered:
        return
    torch.library.register_fake("torchstash::pack_bits", _pack_bits_fake)
    torch.library.register_fake("torchstash::unpack_bits", _unpack_bits_fake)
    torch.library.register_fake("torchstash::philox_uniform", _philox_uniform_fake)
    _registered = True


if _ops_defined():  # imported by torch itself, after the library was loaded elsewhere
    register()
