"""Fake (meta) kernels of the ``torchstash::`` ops, so ``torch.compile`` can trace them.

Each op's fake is a row of :data:`FAKES`: the rules its arguments keep while tracing (the
dispatchers' rules and words, :mod:`._checks`) and the outputs it makes, both reading the
arguments by the names the op's schema gives them (``csrc/bindings/ops.cpp``), which are
the only signature: one generic kernel binds a traced call to those names.

The C++ library names this module (``m.set_python_module``): torch imports it when it
needs a fake kernel, and torch requires the registrations to come from here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ._checks import (
    FLOAT_DTYPES,
    packed_size,
    traced_bits,
    traced_count,
    traced_dtype,
    traced_float,
)
from .maxpool_reference import pool_output_size

_registered = False

#: An op's traced call, its arguments by their schema names (``a.x``, ``a.bits``...).
Args = SimpleNamespace
Rule = Callable[[Args], None]

_SIGN_FLOATS = (*FLOAT_DTYPES, torch.float64)
_OFFSET_BLOCK = 1 << 16


@dataclass(frozen=True)
class Fake:
    """What one op's fake kernel checks and what it returns."""

    rules: Sequence[Rule]
    outputs: Callable[[Args], Any]


# -- the rules, each of one argument (or of one relation) ---------------------------------------


def _bits(a: Args) -> None:
    traced_bits(a.bits)


def _count(name: str, low: int = 1) -> Rule:
    return lambda a: traced_count(getattr(a, name), name, low)


def _float(name: str) -> Rule:
    """A float tensor (its dtype), or a float dtype, of :data:`FLOAT_DTYPES`."""

    def rule(a: Args) -> None:
        value = getattr(a, name)
        traced_float(value.dtype if isinstance(value, torch.Tensor) else value, name)

    return rule


def _dtype(name: str, dtype: torch.dtype) -> Rule:
    return lambda a: traced_dtype(getattr(a, name), name, dtype)


def _sign_float(name: str) -> Rule:
    """A float tensor or dtype the sign ops take (float64 too)."""

    def rule(a: Args) -> None:
        value = getattr(a, name)
        dtype = value.dtype if isinstance(value, torch.Tensor) else value
        what = "a float tensor" if isinstance(value, torch.Tensor) else "a float dtype"
        torch._check(dtype in _SIGN_FLOATS, lambda: f"{name} must be {what}, got {dtype}")

    return rule


def _codes(a: Args) -> None:
    torch._check(
        a.codes.dtype in (torch.uint8, torch.bool),
        lambda: f"codes must be uint8 or bool, got {a.codes.dtype}",
    )


def _seed_tensor(a: Args) -> None:
    """A traced seed: a 0-dim int64 tensor on the CPU or on ``x``'s device."""
    seed = a.seed
    torch._check(
        seed.dtype == torch.int64 and seed.dim() == 0,
        lambda: (
            f"a seed tensor must be a 0-dim int64 tensor, got {seed.dtype} of shape "
            f"{tuple(seed.shape)}"
        ),
    )
    torch._check(
        seed.device.type == "cpu" or seed.device == a.x.device,
        lambda: f"the seed tensor is on {seed.device} but x is on {a.x.device}",
    )


def _level_bits(a: Args) -> None:
    torch._check(a.bits in (2, 4, 8), lambda: f"bits must be 2, 4 or 8, got {a.bits}")


def _signs_of_grad(a: Args) -> None:
    want = (a.grad.numel() + 7) // 8
    torch._check(
        a.packed.numel() == want, lambda: f"packed must hold {want} bytes, got {a.packed.numel()}"
    )


def _mask(a: Args) -> None:
    """A uint8 bit mask of ``numel`` elements (``x``'s where the op has no ``numel``)."""
    numel = a.numel if hasattr(a, "numel") else a.x.numel()
    torch._check(a.mask.dtype == torch.uint8, lambda: f"the mask must be uint8, got {a.mask.dtype}")
    traced_count(numel, "numel", 0)
    torch._check(
        a.mask.numel() == (numel + 7) // 8,
        lambda: f"{numel} elements need a mask of {(numel + 7) // 8} bytes, got {a.mask.numel()}",
    )


# -- the outputs ------------------------------------------------------------------------------


def _empty(like: torch.Tensor, size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return like.new_empty((size,), dtype=dtype)


def _groups(a: Args) -> int:
    return (a.x.numel() + a.group_size - 1) // a.group_size


def _rows(a: Args) -> int:
    return a.x.numel() // a.run


def _group_codes(a: Args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``group_quantize``'s: packed codes, a bfloat16 minimum and step per group."""
    groups = _groups(a)
    return (
        _empty(a.x, packed_size(a.x.numel(), a.bits), torch.uint8),
        _empty(a.x, groups, torch.bfloat16),
        _empty(a.x, groups, torch.bfloat16),
    )


def _row_parts(a: Args) -> tuple[torch.Tensor, torch.Tensor]:
    """A row code's float32 offset per row and its constant rows' bits."""
    rows = _rows(a)
    return _empty(a.x, rows, torch.float32), _empty(a.x, (rows + 7) // 8, torch.uint8)


def _values(a: Args, like: str) -> torch.Tensor:
    """``a.numel`` values of ``a.dtype``, on ``like``'s device."""
    return _empty(getattr(a, like), a.numel, a.dtype)


def _pooled(a: Args) -> torch.Tensor:
    """``max_pool2d_code``'s output: ``x`` with its last two sizes pooled."""
    *lead, h, w = a.x.shape
    sizes = [
        pool_output_size(n, a.kernel[i], a.padding[i], a.stride[i], a.dilation[i], a.ceil_mode)
        for i, n in enumerate((h, w))
    ]
    return a.x.new_empty([*lead, *sizes])


def _pool_codes(a: Args) -> tuple[torch.Tensor, torch.Tensor]:
    out = _pooled(a)
    return out, _empty(a.x, packed_size(out.numel(), a.bits), torch.uint8)


_GROUP_DECODE = (_bits, _dtype("packed", torch.uint8), _float("dtype"))

FAKES: dict[str, Fake] = {
    "pack_bits": Fake(
        (_bits, _codes),
        lambda a: _empty(a.codes, packed_size(a.codes.numel(), a.bits), torch.uint8),
    ),
    "unpack_bits": Fake(
        (_bits, _dtype("packed", torch.uint8)), lambda a: _empty(a.packed, a.numel)
    ),
    "philox_uniform": Fake((_dtype("out", torch.float32),), lambda a: None),
    "group_quantize": Fake((_bits, _count("group_size"), _float("x")), _group_codes),
    "group_quantize.seeded": Fake(
        (_bits, _count("group_size"), _float("x"), _seed_tensor), _group_codes
    ),
    "group_dequantize": Fake(_GROUP_DECODE, lambda a: _values(a, "packed")),
    "channel_minmax": Fake(
        (_float("x"), _count("inner"), _count("channels")),
        lambda a: (
            _empty(a.x, a.channels, torch.float32),
            _empty(a.x, a.channels, torch.float32),
        ),
    ),
    "channel_quantize": Fake(
        (_float("x"), _dtype("lo", torch.float32), _dtype("step", torch.float32), _count("inner")),
        lambda a: _empty(a.x, a.x.numel(), torch.uint8),
    ),
    "mesa_quantize": Fake(
        (_float("x"), _count("inner"), _count("channels"), _count("groups")),
        lambda a: (
            _empty(a.x, a.x.numel(), torch.uint8),
            _empty(a.x, a.groups, torch.float32),
            _empty(a.x, a.groups, torch.float32),
            a.x.new_empty((2, a.groups), dtype=torch.float32),
        ),
    ),
    "channel_dequantize": Fake(
        (
            _dtype("codes", torch.uint8),
            _dtype("lo", torch.float32),
            _dtype("step", torch.float32),
            _count("inner"),
            _float("dtype"),
        ),
        lambda a: _empty(a.codes, a.codes.numel(), a.dtype),
    ),
    "row_center": Fake(
        (_float("x"), _count("run")),
        lambda a: (
            _empty(a.x, a.x.numel(), torch.float32),
            *_row_parts(a),
            _empty(a.x, _rows(a) if a.scale else 0, torch.float32),
        ),
    ),
    "row_uncenter": Fake(
        (_dtype("decoded", torch.float32), _count("run"), _float("dtype")),
        lambda a: _empty(a.decoded, a.decoded.numel(), a.dtype),
    ),
    "row_group_quantize": Fake(
        (_count("run"), _bits, _count("group_size"), _float("x")),
        lambda a: (*_group_codes(a), *_row_parts(a)),
    ),
    "row_group_quantize.seeded": Fake(
        (_count("run"), _bits, _count("group_size"), _float("x"), _seed_tensor),
        lambda a: (*_group_codes(a), *_row_parts(a)),
    ),
    "row_group_dequantize": Fake((_count("run"), *_GROUP_DECODE), lambda a: _values(a, "packed")),
    "fp8_quantize": Fake(
        (_float("x"), _count("group_size")),
        lambda a: (
            _empty(a.x, _groups(a) * a.group_size, torch.uint8),
            _empty(a.x, _groups(a), torch.bfloat16),
        ),
    ),
    "fp8_dequantize": Fake(
        (_dtype("codes", torch.uint8), _dtype("scale", torch.bfloat16), _float("dtype")),
        lambda a: _values(a, "codes"),
    ),
    "level_quantize": Fake(
        (_float("x"), _level_bits, _dtype("levels", torch.float32)),
        lambda a: _empty(a.x, (a.x.numel() * a.bits + 7) // 8, torch.uint8),
    ),
    "sign_pack": Fake(
        (_sign_float("x"),), lambda a: _empty(a.x, (a.x.numel() + 7) // 8, torch.uint8)
    ),
    "sign_unpack": Fake(
        (_dtype("packed", torch.uint8), _sign_float("dtype")), lambda a: _values(a, "packed")
    ),
    "sign_select": Fake(
        (_sign_float("grad"), _dtype("packed", torch.uint8), _signs_of_grad),
        lambda a: _empty(a.grad, a.grad.numel()),
    ),
    "max_pool2d_code": Fake(
        (_dtype("x", torch.float32), _bits, _dtype("table", torch.uint8)), _pool_codes
    ),
    "max_pool2d_code_backward": Fake(
        (_dtype("grad", torch.float32), _bits, _dtype("packed", torch.uint8)),
        lambda a: a.grad.new_empty(list(a.input_size)),
    ),
    "window_code": Fake(
        (_dtype("indices", torch.int64), _bits, _dtype("table", torch.uint8)),
        lambda a: (
            _empty(a.indices, packed_size(a.indices.numel(), a.bits), torch.uint8),
            a.indices.new_empty((), dtype=torch.bool),
        ),
    ),
    "window_indices": Fake(
        (_dtype("packed", torch.uint8), _bits),
        lambda a: a.packed.new_empty(list(a.size), dtype=torch.int64),
    ),
    "topk_mask": Fake(
        (_float("x"), _count("segments"), _count("k", 0)),
        lambda a: _empty(a.x, (a.x.numel() + 7) // 8, torch.uint8),
    ),
    "mask_compact": Fake((_float("x"), _mask, _count("kept", 0)), lambda a: _empty(a.x, a.kept)),
    "mask_scatter": Fake((_mask, _float("values")), lambda a: _empty(a.values, a.numel)),
    "mask_offsets": Fake(
        (_mask, _count("kept", 0)),
        lambda a: (
            _empty(a.mask, a.kept, torch.uint16),
            _empty(a.mask, (a.numel + _OFFSET_BLOCK - 1) // _OFFSET_BLOCK, torch.int32),
        ),
    ),
    "offsets_scatter": Fake(
        (
            _dtype("offsets", torch.uint16),
            _dtype("counts", torch.int32),
            _float("values"),
            _count("numel", 0),
        ),
        lambda a: _empty(a.values, a.numel),
    ),
}


def _overload(name: str) -> Any:
    """The op overload ``name`` names: ``op`` (its default) or ``op.overload``."""
    op, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.torchstash, op), overload or "default")


def kernel(name: str) -> Callable[..., Any]:
    """The fake kernel of op ``name`` (``op`` or ``op.overload``): the traced call bound to its
    schema's argument names, checked by its rules, answered with its outputs' shapes and
    dtypes."""
    fake = FAKES[name]
    names = [arg.name for arg in _overload(name)._schema.arguments]

    def run(*args: Any, **kwargs: Any) -> Any:
        a = Args(**dict(zip(names, args, strict=False)), **kwargs)
        for rule in fake.rules:
            rule(a)
        return fake.outputs(a)

    run.__name__ = run.__qualname__ = f"{name.replace('.', '_')}_fake"
    return run


def _op_defined(name: str) -> bool:
    try:
        _overload(name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _ops_defined() -> bool:
    return _op_defined("pack_bits")


def register() -> None:
    """Registers the fake kernels once per process (the ops must already be defined; a
    library built from older sources, ``TORCHSTASH_CSRC_DIR``, may lack the newer ones)."""
    global _registered
    if _registered:
        return
    for name in FAKES:
        if _op_defined(name):
            torch.library.register_fake(f"torchstash::{name}", kernel(name))
    _registered = True


if _ops_defined():  # imported by torch itself, after the library was loaded elsewhere
    register()
