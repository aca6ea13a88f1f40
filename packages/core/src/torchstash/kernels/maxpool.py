"""memsave's 2-d max pool with its argmax kept as a position in the window: the compiled
kernel on the CPU (one pass each way), else its reference (ATen's pool and the positions
coded with PyTorch ops). ``torchstash.windows.pool_code`` decides when it applies.
``window_code`` / ``window_indices`` code a stock pool's indices as those positions and back
(quant's pool code), one pass each way on the CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import KernelUnavailable
from ._checks import check_bits, check_packed
from ._dispatch import Impl, use_kernel
from .maxpool_reference import (
    max_pool2d_code_backward_ref,
    max_pool2d_code_ref,
    window_code_ref,
    window_indices_ref,
)

__all__ = ["max_pool2d_code", "max_pool2d_code_backward", "window_code", "window_indices"]


def _cpu_kernel(op: str, impl: Impl, device: torch.device) -> bool:
    """Whether ``op`` runs its compiled kernel (CPU only; ``impl='kernel'`` elsewhere raises)."""
    if device.type == "cpu" and use_kernel(impl, device):
        return True
    if impl == "kernel":
        raise KernelUnavailable(
            f"{op}: its compiled kernel runs on the CPU only, the tensor is on {device}; "
            "impl='auto' runs the same steps as PyTorch ops"
        )
    return False


def max_pool2d_code(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    table: torch.Tensor,
    bits: int,
    *,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``F.max_pool2d``'s output, bit for bit, and each output's argmax as its position in
    the window, ``table[offset from the window's first element]``, packed at ``bits`` in the
    outputs' flat order). ``x``: float32, 3-D or 4-D; ``table``: uint8, as
    :mod:`torchstash.windows` builds it."""
    op = "max_pool2d_code"
    check_bits(bits, op=op)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{op}: x must be float32, got {got}; other dtypes take ATen's pool")
    _check_table(table, op)
    args = (list(kernel), list(stride), list(padding), list(dilation), bool(ceil_mode))
    if _cpu_kernel(op, impl, x.device):
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.torchstash.max_pool2d_code(
            x, *args, table, bits
        )
        return out
    return max_pool2d_code_ref(x, *args, table, bits)


def max_pool2d_code_backward(
    grad: torch.Tensor,
    packed: torch.Tensor,
    input_size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    bits: int,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """The pool's input gradient from :func:`max_pool2d_code`'s positions: each output's
    gradient added at its argmax, in output order from zero, as ATen's backward adds it."""
    op = "max_pool2d_code_backward"
    check_bits(bits, op=op)
    if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32:
        got = grad.dtype if isinstance(grad, torch.Tensor) else type(grad).__name__
        raise TypeError(f"{op}: grad must be float32, got {got}")
    check_packed(packed, bits, grad.numel(), op=op)
    args = (
        list(input_size),
        list(kernel),
        list(stride),
        list(padding),
        list(dilation),
        bool(ceil_mode),
    )
    if _cpu_kernel(op, impl, grad.device):
        gx: torch.Tensor = torch.ops.torchstash.max_pool2d_code_backward(grad, packed, *args, bits)
        return gx
    return max_pool2d_code_backward_ref(grad, packed, *args, bits)


def _check_table(table: torch.Tensor, op: str) -> None:
    if not isinstance(table, torch.Tensor) or table.dtype != torch.uint8:
        got = table.dtype if isinstance(table, torch.Tensor) else type(table).__name__
        raise TypeError(
            f"{op}: table must be uint8, got {got}; pass the offset -> position table "
            "torchstash.windows builds"
        )


def window_code(
    indices: torch.Tensor,
    table: torch.Tensor,
    plane: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    bits: int,
    *,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a 2-d max pool's int64 ``indices`` into planes of ``plane`` as positions in their
    windows, ``table[offset]``, packed at ``bits``; a 0-dim bool: whether every position gives
    its index back). ``torchstash.windows.encode_positions`` and its check in one pass."""
    op = "window_code"
    check_bits(bits, op=op)
    if not isinstance(indices, torch.Tensor) or indices.dtype != torch.int64:
        got = indices.dtype if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise TypeError(f"{op}: indices must be int64, got {got}; pass a max pool's indices")
    _check_table(table, op)
    args = (list(plane), list(kernel), list(stride), list(padding), list(dilation))
    if _cpu_kernel(op, impl, indices.device):
        out: tuple[torch.Tensor, torch.Tensor] = torch.ops.torchstash.window_code(
            indices, table, *args, bits
        )
        return out
    return window_code_ref(indices, table, *args, bits)


def window_indices(
    packed: torch.Tensor,
    size: Sequence[int],
    plane: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    bits: int,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:
    """The int64 indices of ``size`` that :func:`window_code` coded."""
    op = "window_indices"
    check_bits(bits, op=op)
    numel = 1
    for n in size:
        numel *= n
    check_packed(packed, bits, numel, op=op)
    args = (list(size), list(plane), list(kernel), list(stride), list(padding), list(dilation))
    if _cpu_kernel(op, impl, packed.device):
        out: torch.Tensor = torch.ops.torchstash.window_indices(packed, *args, bits)
        return out
    return window_indices_ref(packed, *args, bits)
