"""Max-pool indices as positions inside their windows: a 3x3 window's argmax in 4 bits, not 64.

A max pool saves, for its backward, the flat index (int64) of each output's maximum in the
input plane. The window each output reads is fixed by the pool's kernel, stride, padding and
dilation, so that index is the window's first position plus one of ``prod(kernel)`` offsets;
the position among them fits in :func:`window_bits` bits. Shared by the plug-ins that store
pool indices (memsave's pooling layers, quant's op-aware codes).

:func:`pool_code` pools and writes the positions in one kernel pass where it can (a 2-d pool
of contiguous float32 planes on the CPU, :func:`pool_code_refusal` says why not elsewhere),
and :func:`pool_code_backward` scatters the gradient from them: no int64 index is written
or read, where ATen's pool writes them and the coding above reads and writes them again.
:func:`code_indices` codes a stock pool's indices and checks them in one pass (quant's pool
code), :func:`indices_from_code` gives them back.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from .kernels import max_pool2d_code, max_pool2d_code_backward, window_code, window_indices
from .kernels.maxpool_reference import pool_output_size


def window_bits(window: int) -> int | None:
    """The packed width (1, 2, 4 or 8 bits) of an in-window position, None over 256."""
    for bits in (1, 2, 4, 8):
        if window <= 1 << bits:
            return bits
    return None


def window_starts(
    out_sizes: Sequence[int], stride: Sequence[int], padding: Sequence[int], device: torch.device
) -> list[torch.Tensor]:
    """Per spatial dim, each output position's window start, shaped to broadcast."""
    nd = len(out_sizes)
    starts = []
    for i, size in enumerate(out_sizes):
        start = torch.arange(size, device=device) * stride[i] - padding[i]
        starts.append(start.view([size] + [1] * (nd - 1 - i)))
    return starts


def _window_offsets(
    in_sizes: Sequence[int], kernel: Sequence[int], dilation: Sequence[int]
) -> list[int]:
    """Flat-plane offset of each in-window position (row-major over the window)."""
    plane = [math.prod(in_sizes[i + 1 :]) for i in range(len(in_sizes))]
    offsets = [0]
    for i in range(len(kernel)):
        offsets = [o + j * dilation[i] * plane[i] for o in offsets for j in range(kernel[i])]
    return offsets


def _index_dtype(in_sizes: Sequence[int]) -> torch.dtype:
    """int32 for planes that it indexes: half the bytes of each pass over the indices, and an
    ``index_select`` in place of advanced indexing (on a ResNet stem's pool on CPU, encoding
    took 5x less time, decoding 3x)."""
    return torch.int32 if math.prod(in_sizes) < 2**31 else torch.int64


def _window_base(in_sizes: Sequence[int], starts: list[torch.Tensor]) -> torch.Tensor:
    """Flat-plane index of each window's first position (broadcast over the outputs)."""
    base: torch.Tensor | None = None
    for i, start in enumerate(starts):
        term = start * math.prod(in_sizes[i + 1 :])
        base = term if base is None else base + term
    assert base is not None
    return base


@functools.lru_cache(maxsize=128)
def _cached_tables(
    in_sizes: tuple[int, ...],
    kernel: tuple[int, ...],
    dilation: tuple[int, ...],
    device: torch.device,
) -> tuple[torch.Tensor, int, torch.Tensor]:
    return _window_tables(in_sizes, kernel, dilation, device)


def _window_tables(
    in_sizes: Sequence[int], kernel: Sequence[int], dilation: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(offset - lowest offset -> position in the window, the lowest offset, position ->
    offset), on ``device``."""
    offsets = _window_offsets(in_sizes, kernel, dilation)
    low = min(offsets)
    dtype = torch.uint8 if len(offsets) <= 256 else torch.int16
    encode = torch.zeros(max(offsets) - low + 1, dtype=dtype)
    encode[torch.tensor([o - low for o in offsets])] = torch.arange(len(offsets), dtype=dtype)
    decode = torch.tensor(offsets, dtype=_index_dtype(in_sizes))
    return encode.to(device), low, decode.to(device)


def _tables(
    like: torch.Tensor, in_sizes: Sequence[int], kernel: Sequence[int], dilation: Sequence[int]
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A window's lookup tables on ``like``'s device, built once per geometry and device: a
    table built from host values each call is a host-to-device copy the host waits for (on
    CUDA, one per pool in forward and one in backward). A traced or fake tensor (inside
    ``torch.compile``, a fake mode) gets tables of its own, never cached ones."""
    if type(like) is not torch.Tensor or torch.compiler.is_compiling():
        return _window_tables(in_sizes, kernel, dilation, like.device)
    key = (tuple(map(int, in_sizes)), tuple(map(int, kernel)), tuple(map(int, dilation)))
    return _cached_tables(*key, like.device)


@functools.lru_cache(maxsize=256)
def _every_window_inside(
    size: int, kernel: int, padding: int, stride: int, dilation: int, out: int
) -> bool:
    """Whether each of the ``out`` windows along a dim holds an element of the plane (ATen's
    pool gives an empty one, possible with dilation, the index of no element)."""
    for o in range(out):
        start = o * stride - padding
        first = start if start >= 0 else start + (-start + dilation - 1) // dilation * dilation
        if first >= min(start + (kernel - 1) * dilation + 1, size):
            return False
    return True


def pool_code_refusal(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> list[str]:
    """Why :func:`pool_code` cannot pool ``x`` so (empty: it can); the caller then pools with
    ATen and codes the indices (:func:`encode_positions`)."""
    reasons = []
    if x.dtype != torch.float32:
        reasons.append(f"its input is {x.dtype}, the kernel pools float32")
    if x.device.type != "cpu":
        reasons.append(f"its input is on {x.device}, the kernel runs on the CPU")
    if x.dim() not in (3, 4) or len(kernel) != 2:
        reasons.append("it is not a 2-d pool of a 3-D or 4-D input")
    elif not x.is_contiguous():
        reasons.append("its input is not contiguous (channels_last takes ATen's pool)")
    if torch.compiler.is_compiling():
        reasons.append("a compiled graph pools with ATen's op")
    if reasons:
        return reasons
    if int(x.shape[-2]) * int(x.shape[-1]) >= 1 << 30:
        reasons.append("its input plane holds 2^30 elements or more")
    if math.prod(kernel) > 256:
        reasons.append(f"its window holds {math.prod(kernel)} positions, over 256")
    if min(*kernel, *stride, *dilation) < 1 or min(padding) < 0:
        return [*reasons, "its kernel, stride, dilation or padding is out of range"]
    for i in range(2):
        size = int(x.shape[-2 + i])
        if padding[i] > kernel[i] // 2:
            reasons.append("its padding is over half its kernel (ATen refuses it)")
            continue
        out = pool_output_size(size, kernel[i], padding[i], stride[i], dilation[i], ceil_mode)
        if size < 1 or out < 1:
            reasons.append("its input plane holds no window")
        elif not _every_window_inside(size, kernel[i], padding[i], stride[i], dilation[i], out):
            reasons.append("one of its windows lies wholly in the padding")
    return reasons


def pool_code(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(``F.max_pool2d(x, ...)``, bit for bit; each output's argmax as its position in the
    window, packed; the width) in one pass (:func:`torchstash.kernels.max_pool2d_code`). Only
    where :func:`pool_code_refusal` says nothing against it."""
    bits = window_bits(math.prod(kernel))
    assert bits is not None, "pool_code_refusal refuses windows over 256 positions"
    table, low, _ = _tables(x, x.shape[-2:], kernel, dilation)
    assert low == 0  # a window's first element is its lowest offset
    out, packed = max_pool2d_code(x, kernel, stride, padding, dilation, ceil_mode, table, bits)
    return out, packed, bits


def pool_code_backward(
    grad: torch.Tensor,
    packed: torch.Tensor,
    input_size: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
    bits: int,
) -> torch.Tensor:
    """The input's gradient of :func:`pool_code`'s pool, as ATen's backward gives it."""
    return max_pool2d_code_backward(
        grad, packed, input_size, kernel, stride, padding, dilation, ceil_mode, bits
    )


def code_indices(
    indices: torch.Tensor,
    plane: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> tuple[torch.Tensor, int] | None:
    """A stock 2-d pool's int64 ``indices`` (into planes of ``plane``) as their positions in
    their windows, packed, and the width; None when a window holds over 256 positions or a
    position does not give its index back (indices this geometry misreads). One kernel pass
    on the CPU (:func:`torchstash.kernels.window_code`): :func:`encode_positions`, the check
    and the packing."""
    bits = window_bits(math.prod(kernel))
    if bits is None or indices.dim() < 2:
        return None
    table, low, _ = _tables(indices, plane, kernel, dilation)
    assert low == 0  # a window's first element is its lowest offset
    packed, exact = window_code(indices, table, plane, kernel, stride, padding, dilation, bits)
    return (packed, bits) if bool(exact) else None


def indices_from_code(
    packed: torch.Tensor,
    size: Sequence[int],
    plane: Sequence[int],
    kernel: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    bits: int,
) -> torch.Tensor:
    """The int64 indices of ``size`` that :func:`code_indices` coded."""
    return window_indices(packed, size, plane, kernel, stride, padding, dilation, bits)


def encode_positions(
    indices: torch.Tensor,
    in_sizes: Sequence[int],
    starts: list[torch.Tensor],
    kernel: Sequence[int],
    dilation: Sequence[int],
) -> torch.Tensor:
    """Flat spatial indices -> row-major positions inside their windows (uint8, or int16 over
    256 positions).

    An index minus its window's first position is one of the window's offsets; a table from
    offset to position replaces per-element division (one subtraction and one gather). An
    index outside its window gets some position, never an error: a caller that cannot trust
    the indices checks :func:`decode_positions` gives them back.
    """
    table, low, _ = _tables(indices, in_sizes, kernel, dilation)
    itype = _index_dtype(in_sizes)
    relative = indices.to(itype, copy=True)  # a copy: the caller's indices stay as they are
    relative.sub_(_window_base(in_sizes, [s.to(itype) for s in starts])).sub_(low)
    relative.clamp_(0, table.numel() - 1)
    return torch.index_select(table, 0, relative.reshape(-1)).view(indices.shape)


def decode_positions(
    code: torch.Tensor,
    in_sizes: Sequence[int],
    starts: list[torch.Tensor],
    kernel: Sequence[int],
    dilation: Sequence[int],
) -> torch.Tensor:
    """Row-major positions inside windows -> flat spatial indices (int64): the window's first
    position plus the position's offset, looked up."""
    itype = _index_dtype(in_sizes)
    _, _, table = _tables(code, in_sizes, kernel, dilation)
    found = torch.index_select(table, 0, code.reshape(-1).to(itype)).view(code.shape)
    return found.add_(_window_base(in_sizes, [s.to(itype) for s in starts])).long()
