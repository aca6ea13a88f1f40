"""Convolution (Conv1d/2d/3d, ConvTranspose1d/2d/3d) that saves only what the gradients need.

Stock ``ConvolutionBackward0`` always keeps the input, although only the weight gradient reads
it: with a frozen weight (input and/or bias gradients only) the input is dead weight. With
``padding_mode`` reflect or replicate, stock also keeps the unpadded input for the pad's
backward, which reads only its sizes: 2.3x the input, whatever is trainable.

:class:`ConvFunction` saves the input only if the weight gradient is requested and the weight
only if the input gradient is (a ``Parameter`` is kept anyway: a reference costs nothing), and
calls stock's ``aten.convolution_backward`` with layout-faithful stand-ins, so outputs and
gradients are stock's bit for bit. Where it would keep all stock keeps (the weight trains:
every conv of a network training its weights), stock's own op runs instead
(:func:`conv_spares_nothing`): the same saves, without a Python Function's cost per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ._standin import Layout, expand, needs_graph, standin
from ._tracker import apply

__all__ = ["ConvFunction", "PadFunction", "conv", "conv_spares_nothing"]

aten = torch.ops.aten

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
IntOrSeq = int | Sequence[int]


class ConvFunction(torch.autograd.Function):
    """``aten.convolution`` keeping the input only for the weight gradient.

    Stock saves the input even when only the input (or bias) gradient is needed.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        transposed: bool,
        output_padding: list[int],
        groups: int,
    ) -> torch.Tensor:
        out = torch.convolution(
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups
        )
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        keep_w = need_x or isinstance(weight, nn.Parameter)
        ctx.save_for_backward(x if need_w else None, weight if keep_w else None)
        # the layout of what is not kept, for its stand-in
        ctx.layouts = (None if need_w else Layout.of(x), None if keep_w else Layout.of(weight))
        ctx.bias_sizes = None if bias is None else list(bias.shape)
        ctx.conf = (stride, padding, dilation, transposed, output_padding, groups)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        x_layout, w_layout = ctx.layouts
        # the values of a stand-in are never read for the gradients asked; its strides are
        # (a zero-stride input is copied to full size on CPU and changes channels_last results)
        x = x if x_layout is None else standin(x_layout)
        weight = weight if w_layout is None else standin(w_layout)
        mask = list(ctx.needs_input_grad[:3])
        gx, gw, gb = aten.convolution_backward(grad, x, weight, ctx.bias_sizes, *ctx.conf, mask)
        return gx, gw, gb, None, None, None, None, None, None


_PAD_BACKWARD = {
    ("reflect", 1): aten.reflection_pad1d_backward,
    ("reflect", 2): aten.reflection_pad2d_backward,
    ("reflect", 3): aten.reflection_pad3d_backward,
    ("replicate", 1): aten.replication_pad1d_backward,
    ("replicate", 2): aten.replication_pad2d_backward,
    ("replicate", 3): aten.replication_pad3d_backward,
}


class PadFunction(torch.autograd.Function):
    """``F.pad`` in reflect or replicate mode that saves nothing.

    Stock keeps the unpadded input for the pad's backward, which reads only its sizes.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pad: list[int], mode: str) -> torch.Tensor:
        ctx.layout = Layout.of(x)
        ctx.pad = pad
        ctx.mode = mode
        return F.pad(x, pad, mode=mode)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        op = _PAD_BACKWARD[ctx.mode, len(ctx.pad) // 2]
        return op(grad, standin(ctx.layout, sizes_only=True), ctx.pad), None, None


def _batchify(x: torch.Tensor, nd: int, transposed: bool) -> tuple[torch.Tensor, bool]:
    """ATen's ``batchify``: an unbatched input gets a batch dimension of 1."""
    dim = x.dim()
    if dim == nd + 2:
        return x, True
    if dim == nd + 1:
        return x.unsqueeze(0), False
    name = f"conv_transpose{nd}d" if transposed else f"conv{nd}d"
    raise RuntimeError(
        f"Expected {nd + 1}D (unbatched) or {nd + 2}D (batched) input to {name}, "
        f"but got input of size: {list(x.shape)}"
    )


def _same_padding(kernel: Sequence[int], dilation: Sequence[int]) -> tuple[list[int], list[int]]:
    """(left padding per dim, extra right padding per dim) for ``padding='same'``."""
    left, extra = [], []
    for k, d in zip(kernel, dilation):
        total = d * (k - 1)
        left.append(total // 2)
        extra.append(total - 2 * (total // 2))
    return left, extra


def conv_spares_nothing(x: torch.Tensor, weight: torch.Tensor, padding_mode: str) -> bool:
    """Whether :class:`ConvFunction` would keep all stock keeps (the weight trains, so the
    input is kept, and the weight is kept too), with no padding whose input stock keeps
    besides: stock's own op then runs, saving the same without a Python Function's cost."""
    return (
        padding_mode in ("zeros", "circular")
        and weight.requires_grad
        and (x.requires_grad or isinstance(weight, nn.Parameter))
    )


def _stock(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: IntOrSeq,
    padding: IntOrSeq | str,
    dilation: IntOrSeq,
    groups: int,
    transposed: bool,
    output_padding: IntOrSeq,
    pad: list[int] | None,
    padding_mode: str,
) -> torch.Tensor:
    """What the stock modules run (used where no graph is recorded)."""
    nd = weight.dim() - 2
    if transposed:
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        return fn(x, weight, bias, stride, padding, output_padding, groups, dilation)
    fn = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    if pad is not None:
        return fn(F.pad(x, pad, mode=padding_mode), weight, bias, stride, 0, dilation, groups)
    return fn(x, weight, bias, stride, padding, dilation, groups)


def conv(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: IntOrSeq = 1,
    padding: IntOrSeq | str = 0,
    dilation: IntOrSeq = 1,
    groups: int = 1,
    transposed: bool = False,
    output_padding: IntOrSeq = 0,
    padding_mode: str = "zeros",
) -> torch.Tensor:
    """What ``nn.ConvNd`` / ``nn.ConvTransposeNd`` compute (the dimension comes from ``weight``).

    ``padding`` is ints or ``'same'``/``'valid'`` (not with ``transposed``); ``padding_mode``
    other than ``'zeros'`` pads first as the modules do (``padding`` then gives the amounts),
    and ``output_padding`` is the transposed module's (``_output_padding`` resolves it there).
    Saves the input only for the weight gradient and the weight only for the input gradient.
    """
    nd = weight.dim() - 2
    if nd not in (1, 2, 3):
        raise ValueError(f"conv: weight must be 3-D, 4-D or 5-D, got {weight.dim()}-D")
    if padding_mode not in PADDING_MODES:
        raise ValueError(
            f"padding_mode must be one of {PADDING_MODES}, but got padding_mode='{padding_mode}'"
        )
    if isinstance(padding, str) and padding not in ("same", "valid"):
        raise ValueError(f"Invalid padding string {padding!r}, should be one of ('valid', 'same')")
    kernel = list(weight.shape[2:])
    dilation_ = expand(dilation, nd, "conv: dilation")
    stride_ = expand(stride, nd, "conv: stride")
    same = padding == "same"
    amounts = None if isinstance(padding, str) else expand(padding, nd, "conv: padding")
    if transposed:
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for ConvTranspose{nd}d')
        if amounts is None:
            raise ValueError(f"padding={padding!r} is not supported for ConvTranspose{nd}d")
    elif same and any(s != 1 for s in stride_):
        raise ValueError("padding='same' is not supported for strided convolutions")

    # the modules' _reversed_padding_repeated_twice, for the padding modes that pad first
    pad: list[int] | None = None
    if padding_mode != "zeros":
        pad = [0] * (2 * nd)
        left, extra = _same_padding(kernel, dilation_) if same else (amounts or [0] * nd, [0] * nd)
        for i in range(nd):
            pad[2 * (nd - 1 - i)] = left[i]
            pad[2 * (nd - 1 - i) + 1] = left[i] + extra[i]

    if not needs_graph(input, weight, bias) or conv_spares_nothing(input, weight, padding_mode):
        return _stock(
            input,
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
            transposed,
            output_padding,
            pad,
            padding_mode,
        )

    x = input
    if pad is not None:
        # circular padding is a chain of slice copies in stock that saves nothing: kept as is
        x = (
            F.pad(x, pad, mode=padding_mode)
            if padding_mode == "circular"
            else _pad(x, pad, padding_mode)
        )
    x, batched = _batchify(x, nd, transposed)
    if pad is not None or (amounts is None and not same):  # padded already, or 'valid'
        padding_ = [0] * nd
    elif same:
        # ATen's _convolution_mode: symmetric padding in the conv, the odd remainder padded
        # on the right by constant_pad_nd (which saves nothing)
        padding_, extra = _same_padding(kernel, dilation_)
        if any(extra):
            pad_nd = [0] * (2 * nd)
            for i in range(nd):
                pad_nd[2 * (nd - 1 - i) + 1] = extra[i]
            x = torch.constant_pad_nd(x, pad_nd, 0)
    else:
        assert amounts is not None
        padding_ = amounts
    out_pad = expand(output_padding, nd, "conv: output_padding") if transposed else [0] * nd
    out: torch.Tensor = apply(
        ConvFunction, x, weight, bias, stride_, padding_, dilation_, transposed, out_pad, groups
    )
    return out if batched else out.squeeze(0)


def _pad(x: torch.Tensor, pad: list[int], mode: str) -> torch.Tensor:
    out: torch.Tensor = apply(PadFunction, x, pad, mode)
    return out
