"""Pure-PyTorch golden models of the compiled kernels (csrc/README.md has the layouts).

They define the expected bits for the parity tests, and they are the fallback
when the kernels cannot be built, so they are vectorized rather than literal.
"""

from __future__ import annotations

from typing import TypeAlias

import torch

from ._checks import (
    check_bits,
    check_codes,
    check_numel,
    check_packed,
    check_seed,
    check_u64,
    packed_size,
)

__all__ = [
    "pack_bits_ref",
    "philox4x32_10",
    "philox_uniform_ref",
    "sign_pack_ref",
    "sign_select_ref",
    "sign_unpack_ref",
    "unpack_bits_ref",
]

# Philox4x32-10 constants (Random123).
M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
_MASK32 = 0xFFFFFFFF
# Blocks per chunk: keeps the ~10 int64 temporaries of a round inside the caches.
_PHILOX_CHUNK = 1 << 16


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def pack_bits_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs uint8/bool ``codes`` (any shape, low ``bits`` bits kept) into 1-D uint8."""
    check_bits(bits, op="pack_bits_ref")
    check_codes(codes, bits, op="pack_bits_ref")
    n = codes.numel()
    if bits == 8:
        out = torch.empty(n, dtype=torch.uint8, device=codes.device)
        out.view(codes.shape).copy_(codes)  # one copy whatever the strides
        return out
    flat = codes.reshape(-1)  # a view when contiguous
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    per, mask = 8 // bits, (1 << bits) - 1
    full = n // per  # bytes whose codes are all present
    shifts = _shifts(bits, codes.device)
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    rows = flat[: full * per].view(full, per)
    if per <= 4:  # few columns: or-ing strided columns beats a reduction over short rows
        body = torch.bitwise_and(rows[:, 0], mask, out=out[:full])
        for k in range(1, per):
            body |= (rows[:, k] & mask) << (k * bits)
    else:
        fields = rows & mask
        fields <<= shifts
        torch.sum(fields, dim=1, dtype=torch.uint8, out=out[:full])  # disjoint fields: sum == or
    if full < out.numel():
        tail = (flat[full * per :] & mask) << shifts[: n - full * per]
        out[full:] = tail.sum(dtype=torch.uint8)
    return out


def unpack_bits_ref(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Unpacks the first ``numel`` codes of a 1-D uint8 ``packed`` buffer."""
    check_bits(bits, op="unpack_bits_ref")
    check_numel(numel, op="unpack_bits_ref")
    check_packed(packed, bits, numel, op="unpack_bits_ref")
    if bits == 8:
        return packed.clone(memory_format=torch.contiguous_format)
    codes = packed.unsqueeze(1) >> _shifts(bits, packed.device)
    codes &= (1 << bits) - 1
    return codes.view(-1)[:numel]


def sign_pack_ref(x: torch.Tensor) -> torch.Tensor:
    """Where float ``x`` is above zero, NaN included (``~(x <= 0)``), packed one bit per
    element in ``x.contiguous()`` order: what a ReLU's backward reads of its output."""
    return pack_bits_ref(~(x <= 0), 1)


def sign_unpack_ref(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """1.0 where :func:`sign_pack_ref`'s bit is set, else 0.0: 1-D ``dtype`` of ``numel``."""
    return unpack_bits_ref(packed, 1, numel).to(dtype)


def sign_select_ref(grad: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``grad`` (in ``grad.contiguous()`` order, 1-D) where :func:`sign_pack_ref`'s bit is set,
    else 0.0: ``threshold_backward(grad, values, 0)`` for values whose signs were packed."""
    keep = unpack_bits_ref(packed, 1, grad.numel()).bool()
    return torch.where(
        keep, grad.reshape(-1), torch.zeros((), dtype=grad.dtype, device=grad.device)
    )


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b, for a < 2**32 and int64 b in [0, 2**32).

    b is split into 16-bit halves, so every partial product stays below 2**49.
    """
    x = (b & 0xFFFF) * a
    y = (b >> 16) * a
    t = x + ((y & 0xFFFF) << 16)
    return (y >> 16) + (t >> 32), t & _MASK32


#: A seed: an int in [0, 2**64), or (traced, where an int would be a graph's constant) a
#: 0-dim int64 tensor holding its 64 bits (:func:`~torchstash.kernels._checks.as_int64`).
Seed: TypeAlias = int | torch.Tensor


def philox4x32_10(
    counter: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    key: tuple[int, int] | tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (the Random123 algorithm); the key
    two 32-bit words, as ints or as 0-dim int64 tensors."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(ROUNDS):
        if r:
            k0, k1 = (k0 + W0) & _MASK32, (k1 + W1) & _MASK32
        hi0, lo0 = _mulhilo(M0, c0)
        hi1, lo1 = _mulhilo(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _philox_blocks(
    first: int, count: int, seed: Seed, offset: int, device: torch.device
) -> torch.Tensor:
    """The (count, 4) int64 output words of blocks [first, first + count)."""
    block = torch.arange(first, first + count, dtype=torch.int64, device=device)
    counter = (
        block & _MASK32,
        block >> 32,
        torch.full_like(block, offset & _MASK32),
        torch.full_like(block, offset >> 32),
    )
    key = (seed & _MASK32, (seed >> 32) & _MASK32)  # a tensor's high word: shifted with its sign
    return torch.stack(philox4x32_10(counter, key), dim=1)


def philox_uniform_ref(
    numel: int, seed: Seed, offset: int = 0, *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``numel`` float32 uniforms in [0, 1) from Philox4x32-10 at (seed, offset). A tensor
    seed (see :data:`Seed`) draws the same numbers, and inside ``torch.compile`` it is an
    input of the graph: a new seed each step, no recompilation."""
    check_numel(numel, op="philox_uniform_ref")
    check_seed(seed, op="philox_uniform_ref")
    check_u64(offset, "offset", op="philox_uniform_ref")
    dev = torch.device(device)
    out = torch.empty(numel, dtype=torch.float32, device=dev)
    blocks = (numel + 3) // 4
    for first in range(0, blocks, _PHILOX_CHUNK):
        count = min(_PHILOX_CHUNK, blocks - first)
        words = _philox_blocks(first, count, seed, offset, dev).view(-1)
        lo, hi = first * 4, min(numel, (first + count) * 4)
        out[lo:hi] = (words[: hi - lo] >> 8).to(torch.float32) * 2.0**-24
    return out
