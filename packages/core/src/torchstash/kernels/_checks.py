"""The rules of the kernels' arguments, each said once: what the dispatchers check before
either implementation runs (the same exceptions and messages whichever runs), and what the
fake kernels check while ``torch.compile`` traces (:func:`traced_bits`, :func:`traced_float`,
:func:`traced_count`: the same allowed values, the same words). The C++ ops check them a
third time (``csrc/bindings/checks.h``); ``tests/test_kernel_args.py`` holds all three to
these rules, op by op.
"""

from __future__ import annotations

import torch

BITS = (1, 2, 4, 8)
#: The floating-point dtypes the float ops read and write.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FLOATS = "float32, float16, bfloat16"
_U64 = 1 << 64


def _bits_text(bits: object) -> str:
    return f"bits={bits!r} is not supported; allowed values are 1, 2, 4, 8"


def _float_text(name: str, got: object) -> str:
    return f"{name} must be one of {_FLOATS}, got {got}"


def _count_text(name: str, value: object, low: int, usual: str) -> str:
    return f"{name} must be an int >= {low}{usual}, got {value!r}"


def check_bits(bits: int, *, op: str) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        raise ValueError(f"{op}: {_bits_text(bits)}")
    return bits


def check_tensor(t: object, name: str, *, op: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_float_dtype(dtype: object, name: str, *, op: str) -> None:
    """``dtype`` (a tensor's, or an output's) one of :data:`FLOAT_DTYPES`."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {_float_text(name, dtype)}; convert with .float()")


def check_float_tensor(t: object, name: str, *, op: str) -> torch.Tensor:
    check_float_dtype(check_tensor(t, name, op=op).dtype, name, op=op)
    assert isinstance(t, torch.Tensor)
    return t


def check_count(value: object, name: str, *, op: str, low: int = 1, hint: str = "") -> int:
    """An int of at least ``low`` (not a bool); ``hint`` says what it counts. A size of a
    graph traced with dynamic shapes (a SymInt) is checked as the fake kernels check it."""
    if isinstance(value, torch.SymInt):
        traced_count(value, name, low)
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        tail = f"; {hint}" if hint else ""
        raise ValueError(f"{op}: {_count_text(name, value, low, '')}{tail}")
    return value


def check_group_size(group_size: object, *, op: str) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{op}: {_count_text('group_size', group_size, 1, ' (256 is usual)')}")
    return group_size


def check_flag(value: object, name: str, *, op: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")
    return value


# -- the same rules while torch.compile traces (the fake kernels) ------------------------------


def traced_bits(bits: int) -> None:
    torch._check(bits in BITS, lambda: _bits_text(bits))


def traced_float(dtype: torch.dtype, name: str) -> None:
    torch._check(dtype in FLOAT_DTYPES, lambda: _float_text(name, dtype))


def traced_count(value: int, name: str, low: int = 1) -> None:
    torch._check(value >= low, lambda: _count_text(name, value, low, ""))


def traced_dtype(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    torch._check(t.dtype == dtype, lambda: f"{name} must be {dtype}, got {t.dtype}")


def check_numel(numel: int, *, op: str) -> int:
    if isinstance(numel, torch.SymInt):  # a size of a graph traced with dynamic shapes
        traced_count(numel, "numel", 0)
        return numel
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


def check_bytes(t: torch.Tensor, name: str, made_by: str, *, op: str) -> torch.Tensor:
    """``t`` is a 1-D uint8 tensor, as the op ``made_by`` returns its codes."""
    t = check_tensor(t, name, op=op)
    if t.dtype != torch.uint8:
        raise TypeError(
            f"{op}: {name} must be uint8, got {t.dtype}; pass the tensor {made_by} returned"
        )
    if t.dim() != 1:
        raise ValueError(
            f"{op}: {name} must be 1-D, got {t.dim()} dims; "
            f"pass the tensor {made_by} returned, or flatten it"
        )
    return t


def check_packed(packed: torch.Tensor, bits: int, numel: int, *, op: str) -> None:
    check_bytes(packed, "packed", "pack_bits", op=op)
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


def check_seed(seed: object, *, op: str, device: torch.device | None = None) -> None:
    """An int in [0, 2**64), or a 0-dim int64 tensor holding one's 64 bits (a traced seed),
    on the CPU or on ``device`` (the data's)."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int64 or seed.dim() != 0:
            raise ValueError(
                f"{op}: a seed tensor must be a 0-dim int64 tensor, got {seed.dtype} of shape "
                f"{tuple(seed.shape)}; make it with torch.tensor(as_int64(seed))"
            )
        if device is not None and seed.device.type != "cpu" and seed.device != device:
            raise ValueError(
                f"{op}: the seed tensor is on {seed.device} but x is on {device}; keep it on "
                "the CPU or on x's device"
            )
        return
    check_u64(seed, "seed", op=op)  # type: ignore[arg-type]


def as_int64(value: int) -> int:
    """The int64 with the same 64-bit pattern as ``value`` in [0, 2**64) (for op schemas)."""
    return value - _U64 if value >= 1 << 63 else value
