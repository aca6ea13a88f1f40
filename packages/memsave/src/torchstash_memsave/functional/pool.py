"""Max, average and adaptive average pooling that save (next to) nothing.

* MaxPool: stock keeps the input (its backward reads only the sizes) and int64 indices. Here
  only the position inside the window is kept, at 1, 2, 4 or 8 bits (2x2: 2 bits, 3x3: 4
  bits); the global index is rebuilt in backward. Windows over 256 elements keep int16
  positions, over 32767 the int64 indices (never the input). A 2-d pool of contiguous float32
  planes on the CPU that returns no indices writes the positions as it pools and scatters
  the gradient from them, one kernel pass each way (:func:`torchstash.windows.pool_code`:
  its forward took a fifth of ATen's pool alone on a ResNet stem's, and no int64 index is
  written or read); elsewhere ATen pools and the indices are coded after.
* AvgPool and AdaptiveAvgPool: stock keeps the input, whose backward reads only its sizes;
  here nothing is kept. AdaptiveAvgPool with output size 1 is stock's ``mean``, which saves
  nothing already: it is called unchanged (another backward op would not be bit-exact).

1-d pooling is 2-d pooling on ``input.unsqueeze(-2)``, as in ATen, so it takes the same path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from torchstash.windows import (
    decode_positions,
    encode_positions,
    pool_code,
    pool_code_backward,
    pool_code_refusal,
    window_bits,
    window_starts,
)

from ._standin import Layout, expand, needs_graph, pack_codes, standin, unpack_codes
from ._tracker import apply

__all__ = [
    "AdaptiveAvgPoolFunction",
    "AvgPoolFunction",
    "MaxPoolCodeFunction",
    "MaxPoolFunction",
    "adaptive_avg_pool1d",
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "avg_pool1d",
    "avg_pool2d",
    "avg_pool3d",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
]

aten = torch.ops.aten

IntOrSeq = int | Sequence[int]

_MAX_POOL = {2: aten.max_pool2d_with_indices, 3: aten.max_pool3d_with_indices}
_MAX_POOL_BACKWARD = {
    2: aten.max_pool2d_with_indices_backward,
    3: aten.max_pool3d_with_indices_backward,
}
_AVG_POOL = {2: aten.avg_pool2d, 3: aten.avg_pool3d}
_AVG_POOL_BACKWARD = {2: aten.avg_pool2d_backward, 3: aten.avg_pool3d_backward}
_ADAPTIVE = {2: aten._adaptive_avg_pool2d, 3: aten._adaptive_avg_pool3d}
_ADAPTIVE_BACKWARD = {
    2: aten._adaptive_avg_pool2d_backward,
    3: aten._adaptive_avg_pool3d_backward,
}


class MaxPoolFunction(torch.autograd.Function):
    """``aten.max_pool{2,3}d_with_indices`` keeping only the in-window position of each max.

    Stock keeps the input (only its sizes are read) and int64 indices.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        kernel: list[int],
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        ceil_mode: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        nd = len(kernel)
        out, indices = _MAX_POOL[nd](x, kernel, stride, padding, dilation, ceil_mode)
        ctx.mark_non_differentiable(indices)
        ctx.set_materialize_grads(False)  # no int64 zeros for the indices' gradient
        ctx.conf = (kernel, stride, padding, dilation, ceil_mode)
        ctx.layout = Layout.of(x)
        ctx.out_sizes = tuple(out.shape[-nd:])
        ctx.code = None
        if not ctx.needs_input_grad[0]:
            ctx.save_for_backward(None)
            return out, indices
        window = math.prod(kernel)
        bits = window_bits(window)
        if window > 2**15 - 1:  # keep stock's indices (still not the input)
            ctx.save_for_backward(indices)
            return out, indices
        starts = window_starts(ctx.out_sizes, stride, padding, x.device)
        code = encode_positions(indices, x.shape[-nd:], starts, kernel, dilation)
        if bits is None:
            ctx.save_for_backward(code.to(torch.int16))
            ctx.code = (None, tuple(code.shape), None)
        else:
            packed, inverse = pack_codes(code.to(torch.uint8), bits)
            ctx.save_for_backward(packed)
            ctx.code = (bits, tuple(code.shape), inverse)
        return out, indices

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, grad: torch.Tensor | None, grad_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        del grad_indices
        if grad is None:
            return None, None, None, None, None, None
        (saved,) = ctx.saved_tensors
        kernel, stride, padding, dilation, ceil_mode = ctx.conf
        nd = len(kernel)
        if ctx.code is None:
            indices = saved
        else:
            bits, shape, inverse = ctx.code
            code = saved if bits is None else unpack_codes(saved, bits, shape, inverse)
            starts = window_starts(ctx.out_sizes, stride, padding, grad.device)
            indices = decode_positions(code, ctx.layout.shape[-nd:], starts, kernel, dilation)
        x = standin(ctx.layout, sizes_only=True)
        gx = _MAX_POOL_BACKWARD[nd](grad, x, kernel, stride, padding, dilation, ceil_mode, indices)
        return gx, None, None, None, None, None


class MaxPoolCodeFunction(torch.autograd.Function):
    """A 2-d max pool that returns no indices, in one kernel pass each way
    (:func:`torchstash.windows.pool_code`): the positions are written as it pools, and the
    backward scatters the gradient from them. The same code as :class:`MaxPoolFunction`'s."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        kernel: list[int],
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        ceil_mode: bool,
    ) -> torch.Tensor:
        out, packed, bits = pool_code(x, kernel, stride, padding, dilation, ceil_mode)
        ctx.conf = (kernel, stride, padding, dilation, ceil_mode, bits)
        ctx.input_size = tuple(x.shape)
        ctx.save_for_backward(packed if ctx.needs_input_grad[0] else None)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (packed,) = ctx.saved_tensors
        if packed is None:
            return None, None, None, None, None, None
        gx = pool_code_backward(grad, packed, ctx.input_size, *ctx.conf)
        return gx, None, None, None, None, None


def _max_pool(
    x: torch.Tensor,
    nd: int,
    kernel_size: IntOrSeq,
    stride: IntOrSeq | None,
    padding: IntOrSeq,
    dilation: IntOrSeq,
    ceil_mode: bool,
    return_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the pool's output, its indices: None where they were not asked for and the pool
    ran as :class:`MaxPoolCodeFunction`)."""
    kernel = expand(kernel_size, nd, "kernel_size")
    stride_ = _stride(stride, kernel, nd)
    padding_ = expand(padding, nd, "padding")
    dilation_ = expand(dilation, nd, "dilation")
    conf = (kernel, stride_, padding_, dilation_, ceil_mode)
    if not return_indices and not pool_code_refusal(x, *conf):
        return apply(MaxPoolCodeFunction, x, *conf), None
    out: tuple[torch.Tensor, torch.Tensor] = apply(MaxPoolFunction, x, *conf)
    return out


def _stride(stride: IntOrSeq | None, kernel: list[int], nd: int) -> list[int]:
    """The kernel size where no stride is given (None or empty, as ATen reads it)."""
    if stride is None or (not isinstance(stride, int) and len(stride) == 0):
        return kernel
    return expand(stride, nd, "stride")


def _check_1d(x: torch.Tensor, name: str) -> None:
    if x.dim() not in (2, 3):
        raise RuntimeError(
            f"{name}() Expected 2D or 3D input tensor, but got {x.dim()}D input: {list(x.shape)}"
        )


def _one(value: IntOrSeq, name: str) -> int:
    values = expand(value, 1, name)
    return values[0]


def _max_pool1d_as_2d(
    input: torch.Tensor,
    kernel_size: IntOrSeq,
    stride: IntOrSeq | None,
    padding: IntOrSeq,
    dilation: IntOrSeq,
    ceil_mode: bool,
    return_indices: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 1-d pool as a 2-d one over a height of 1 (the positions' code is the 2-d one's)."""
    _check_1d(input, "max_pool1d")
    k = _one(kernel_size, "kernel_size")
    s = _stride(stride, [k], 1)[0]
    pad, dil = [0, _one(padding, "padding")], [1, _one(dilation, "dilation")]
    out, indices = _max_pool(
        input.unsqueeze(-2), 2, [1, k], [1, s], pad, dil, ceil_mode, return_indices
    )
    return out.squeeze(-2), None if indices is None else indices.squeeze(-2)


_F = TypeVar("_F", bound=Callable[..., Any])


def _named(f: _F, name: str, what: str) -> _F:
    """``f`` named as the ``F`` function it stands for, its docstring saying what it keeps."""
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"``F.{name}``: {what}."
    return f


def _max_pool_nd(nd: int, stock: Callable[..., Any]) -> Callable[..., Any]:
    """``F.max_pool{nd}d`` (1, 2 or 3) keeping the in-window position of each max."""

    def max_pool(
        input: torch.Tensor,
        kernel_size: IntOrSeq,
        stride: IntOrSeq | None = None,
        padding: IntOrSeq = 0,
        dilation: IntOrSeq = 1,
        ceil_mode: bool = False,
        return_indices: bool = False,
    ) -> Any:
        if not needs_graph(input):
            return stock(input, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
        if nd == 1:
            out, indices = _max_pool1d_as_2d(
                input, kernel_size, stride, padding, dilation, ceil_mode, return_indices
            )
        else:
            out, indices = _max_pool(
                input, nd, kernel_size, stride, padding, dilation, ceil_mode, return_indices
            )
        return (out, indices) if return_indices else out

    return _named(
        max_pool, f"max_pool{nd}d", "keeps the in-window position of each max at 1-8 bits"
    )


max_pool1d = _max_pool_nd(1, F.max_pool1d)
max_pool2d = _max_pool_nd(2, F.max_pool2d)
max_pool3d = _max_pool_nd(3, F.max_pool3d)


class AvgPoolFunction(torch.autograd.Function):
    """``aten.avg_pool{2,3}d`` keeping nothing: stock keeps the input for its sizes."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        kernel: list[int],
        stride: list[int],
        padding: list[int],
        ceil_mode: bool,
        count_include_pad: bool,
        divisor_override: int | None,
    ) -> torch.Tensor:
        conf = (kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        ctx.conf = conf
        ctx.layout = Layout.of(x)
        out: torch.Tensor = _AVG_POOL[len(kernel)](x, *conf)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x = standin(ctx.layout, sizes_only=True)
        gx = _AVG_POOL_BACKWARD[len(ctx.conf[0])](grad, x, *ctx.conf)
        return gx, None, None, None, None, None, None


def _avg_pool(
    x: torch.Tensor,
    nd: int,
    kernel_size: IntOrSeq,
    stride: IntOrSeq | None,
    padding: IntOrSeq,
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> torch.Tensor:
    kernel = expand(kernel_size, nd, "kernel_size")
    stride_ = _stride(stride, kernel, nd)
    out: torch.Tensor = apply(
        AvgPoolFunction,
        x,
        kernel,
        stride_,
        expand(padding, nd, "padding"),
        ceil_mode,
        count_include_pad,
        divisor_override,
    )
    return out


def avg_pool1d(
    input: torch.Tensor,
    kernel_size: IntOrSeq,
    stride: IntOrSeq | None = None,
    padding: IntOrSeq = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
) -> torch.Tensor:
    """``F.avg_pool1d``: keeps nothing (stock: the input, for its sizes)."""
    if not needs_graph(input):
        return F.avg_pool1d(input, kernel_size, stride, padding, ceil_mode, count_include_pad)
    _check_1d(input, "avg_pool1d")
    k = _one(kernel_size, "kernel_size")
    s = _stride(stride, [k], 1)[0]
    out = _avg_pool(
        input.unsqueeze(-2),
        2,
        [1, k],
        [1, s],
        [0, _one(padding, "padding")],
        ceil_mode,
        count_include_pad,
        None,
    )
    return out.squeeze(-2)


def _avg_pool_nd(nd: int, stock: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``F.avg_pool{nd}d`` (2 or 3) keeping nothing."""

    def avg_pool(
        input: torch.Tensor,
        kernel_size: IntOrSeq,
        stride: IntOrSeq | None = None,
        padding: IntOrSeq = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> torch.Tensor:
        args = (stride, padding, ceil_mode, count_include_pad, divisor_override)
        if not needs_graph(input):
            out: torch.Tensor = stock(input, kernel_size, *args)
            return out
        return _avg_pool(input, nd, kernel_size, *args)

    return _named(avg_pool, f"avg_pool{nd}d", "keeps nothing (stock: the input, for its sizes)")


avg_pool2d = _avg_pool_nd(2, F.avg_pool2d)
avg_pool3d = _avg_pool_nd(3, F.avg_pool3d)


class AdaptiveAvgPoolFunction(torch.autograd.Function):
    """``aten._adaptive_avg_pool{2,3}d`` keeping nothing: stock keeps the input for its sizes."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_size: list[int]) -> torch.Tensor:
        ctx.nd = len(output_size)
        ctx.layout = Layout.of(x)
        out: torch.Tensor = _ADAPTIVE[ctx.nd](x, output_size)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x = standin(ctx.layout, sizes_only=True)
        return _ADAPTIVE_BACKWARD[ctx.nd](grad, x), None


OutputSize = int | None | Sequence[int | None]


def _output_size(x: torch.Tensor, output_size: OutputSize, nd: int) -> list[int] | None:
    """``F.adaptive_avg_poolNd``'s ``_list_with_default`` (None keeps the input's size);
    None where stock's op would refuse the sizes (it is then called to raise its error)."""
    if isinstance(output_size, int):
        return [output_size] * nd
    if output_size is None or len(output_size) != nd:
        return None
    if x.dim() <= nd:
        raise ValueError(f"Input dimension should be at least {nd + 1}")
    return [x.shape[i - nd] if s is None else int(s) for i, s in enumerate(output_size)]


def _adaptive(x: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    out: torch.Tensor = apply(AdaptiveAvgPoolFunction, x, output_size)
    return out


def adaptive_avg_pool1d(input: torch.Tensor, output_size: IntOrSeq) -> torch.Tensor:
    """``F.adaptive_avg_pool1d``: keeps nothing (stock: the input); size 1 is stock's mean."""
    size = _one(output_size, "output_size")
    if not needs_graph(input) or size == 1:
        return F.adaptive_avg_pool1d(input, output_size)
    _check_1d(input, "adaptive_avg_pool1d")
    return _adaptive(input.unsqueeze(-2), [1, size]).squeeze(-2)


def _adaptive_nd(nd: int, stock: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """``F.adaptive_avg_pool{nd}d`` (2 or 3) keeping nothing; an output of ones is stock's
    mean, which saves nothing already."""

    def adaptive_avg_pool(input: torch.Tensor, output_size: OutputSize) -> torch.Tensor:
        size = _output_size(input, output_size, nd)
        if not needs_graph(input) or size is None or size == [1] * nd:
            out: torch.Tensor = stock(input, output_size)
            return out
        return _adaptive(input, size)

    what = "keeps nothing (stock: the input); an output of ones is stock's mean"
    return _named(adaptive_avg_pool, f"adaptive_avg_pool{nd}d", what)


adaptive_avg_pool2d = _adaptive_nd(2, F.adaptive_avg_pool2d)
adaptive_avg_pool3d = _adaptive_nd(3, F.adaptive_avg_pool3d)
