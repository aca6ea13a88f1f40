"""BatchNorm, LayerNorm, GroupNorm and RMSNorm that save only what the gradients need.

What stock keeps that the requested gradients do not read:

* BatchNorm in eval keeps the input for every pattern, but only the weight gradient reads it
  (the input gradient is ``grad * weight * invstd(running_var)``);
* BatchNorm, LayerNorm and GroupNorm keep the input and statistics when only the bias is
  trainable (its gradient is a sum of ``grad``);
* RMSNorm runs as a composite on CPU and keeps a normalized copy beside the input, and for
  bf16/fp16 inputs float32 upcasts of both (2-4x the input).

The Functions call stock's forward op and stock's backward op, passing the incoming gradient
as the stand-in for an input that was not saved (same layout: no allocation, same kernel
path), so outputs, gradients and running statistics are stock's bit for bit. Where a Function
would keep all stock keeps (every norm of a network training its weights), stock's own op
runs instead (the ``*_spares_nothing`` checks): the same saves, without a Python Function's
cost per call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ._standin import Layout, needs_graph, standin, suggest_memory_format
from ._tracker import apply

__all__ = [
    "BatchNormFunction",
    "GroupNormFunction",
    "LayerNormFunction",
    "RMSNormFunction",
    "batch_norm",
    "batch_norm_spares_nothing",
    "group_norm",
    "group_norm_spares_nothing",
    "layer_norm",
    "layer_norm_spares_nothing",
    "module_batch_norm",
    "rms_norm",
]

aten = torch.ops.aten

# _batch_norm_impl_index's backend index: 0 native (CPU, and CUDA without cuDNN), 1 cuDNN,
# 2 MIOpen. cuDNN and MIOpen compute every gradient from the input (CUDA only).
_NATIVE = 0


def _layout_or_none(t: torch.Tensor | None) -> Layout | None:
    return None if t is None else Layout.of(t)


class BatchNormFunction(torch.autograd.Function):
    """``aten._batch_norm_impl_index`` (stock's backend choice) keeping the input only if read.

    Stock keeps the input in eval (only the weight gradient reads it there) and when only the
    bias is trainable.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        training: bool,
        momentum: float,
        eps: float,
        cudnn_enabled: bool,
    ) -> torch.Tensor:
        out, save_mean, save_invstd, reserve, impl = torch._batch_norm_impl_index(
            x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
        )
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        if training and impl != _NATIVE:  # CUDA only: cuDNN/MIOpen read the input for all
            keep_x = need_x or need_w or need_b
        elif training:  # x_hat needs the input and batch statistics for both gradients
            keep_x = need_x or need_w
        else:  # the running statistics: the input gradient does not read the input
            keep_x = need_w
        keep_w = weight is not None and (
            need_x or isinstance(weight, nn.Parameter) or impl != _NATIVE
        )
        ctx.save_for_backward(
            x if keep_x else None,
            weight if keep_w else None,
            running_mean if not training else None,  # buffers: references, version-checked
            running_var if not training else None,
            # in eval these are empty and the backward kernel must get them: CUDA's asserts
            # they are defined, and recomputes them from the running statistics when empty
            save_mean if keep_x or not training else None,
            save_invstd if keep_x or not training else None,
            reserve if impl != _NATIVE else None,
        )
        ctx.meta = (  # the layouts of what is not kept, for the stand-ins
            None if keep_x else Layout.of(x),
            None if keep_w else _layout_or_none(weight),
            Layout.of(save_mean) if training and not keep_x else None,
            training,
            eps,
            int(impl),
        )
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, running_mean, running_var, save_mean, save_invstd, reserve = ctx.saved_tensors
        x_layout, w_layout, stat_layout, training, eps, impl = ctx.meta
        if x_layout is not None:
            # unread for the gradients asked, but the layout picks the kernel's reduction order
            # (a zero-stride input changes the bias gradient's bits)
            x = standin(x_layout, grad=grad)
        if stat_layout is not None:  # read per channel by the kernel (into an unused product)
            save_mean = save_invstd = standin(stat_layout)
        if w_layout is not None:
            weight = standin(w_layout)
        mask = list(ctx.needs_input_grad[:3])
        # what both backward kernels read after their inputs, in the same order
        rest = (weight, running_mean, running_var, save_mean, save_invstd, training, eps, mask)
        if impl == _NATIVE or not training:
            gx, gw, gb = aten.native_batch_norm_backward(grad, x, *rest)
        else:  # CUDA only (cuDNN / MIOpen): untested on CPU-only machines
            layout = suggest_memory_format(x)  # what cuDNN was given
            gx, gw, gb = aten._batch_norm_impl_index_backward(
                impl, x.contiguous(memory_format=layout), grad.contiguous(memory_format=layout),
                *rest, reserve,
            )  # fmt: skip
            gx, gw, gb = (g if need else None for g, need in zip((gx, gw, gb), mask))
        return gx, gw, gb, None, None, None, None, None, None


def _verify_batch_size(size: Sequence[int]) -> None:
    if math.prod(size[2:]) * size[0] == 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {size}"
        )


def batch_norm_spares_nothing(x: torch.Tensor, weight: torch.Tensor | None, training: bool) -> bool:
    """Whether :class:`BatchNormFunction` would keep all stock keeps: the input (read by the
    weight gradient, and in training by the input gradient too) and the weight."""
    need_x = x.requires_grad
    keep_x = (weight is not None and weight.requires_grad) or (training and need_x)
    return keep_x and (weight is None or need_x or isinstance(weight, nn.Parameter))


def batch_norm(
    input: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.batch_norm``: keeps the input only where the gradients asked for read it."""
    if (
        not needs_graph(input, weight, bias)
        or input.numel() == 0
        or batch_norm_spares_nothing(input, weight, training)
    ):
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
    if training:
        _verify_batch_size(input.size())
    out: torch.Tensor = apply(
        BatchNormFunction,
        input,
        weight,
        bias,
        running_mean,
        running_var,
        training,
        momentum,
        eps,
        torch.backends.cudnn.enabled,
    )
    return out


def module_batch_norm(
    input: torch.Tensor,
    *,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    num_batches_tracked: torch.Tensor | None,
    training: bool,
    track_running_stats: bool,
    momentum: float | None,
    eps: float,
) -> torch.Tensor:
    """``nn.BatchNorm*d.forward`` from the module's state (its ``_check_input_dim`` aside).

    Bumps ``num_batches_tracked`` and picks the averaging factor (``momentum=None``: the
    cumulative average) and the buffers to pass exactly as ``_BatchNorm.forward`` does.
    """
    factor = 0.0 if momentum is None else momentum
    if training and track_running_stats and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        factor = 1.0 / float(num_batches_tracked) if momentum is None else momentum
    bn_training = training or (running_mean is None and running_var is None)
    use_buffers = not training or track_running_stats
    return batch_norm(
        input,
        running_mean if use_buffers else None,
        running_var if use_buffers else None,
        weight,
        bias,
        bn_training,
        factor,
        eps,
    )


def _keep_for_grads(
    ctx: Any,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    need_x: bool,
    need_w: bool,
) -> tuple[Layout | None, Layout | None, Layout | None]:
    """A norm's saves, kept only for the input and weight gradients (stock keeps them for a
    bias gradient too): the input and statistics when either is asked for, the weight when
    the input's is or the weight is a Parameter. Returns the layouts of what is not kept (the
    input's, the statistics', the weight's), for :func:`_restore_for_grads`' stand-ins."""
    keep = need_x or need_w
    keep_w = weight is not None and (need_x or isinstance(weight, nn.Parameter))
    ctx.save_for_backward(
        x if keep else None,
        mean if keep else None,
        rstd if keep else None,
        weight if keep_w else None,
    )
    return (
        None if keep else Layout.of(x),
        None if keep else Layout.of(mean),
        None if keep_w else _layout_or_none(weight),
    )


def _restore_for_grads(
    ctx: Any,
    grad: torch.Tensor,
    x_layout: Layout | None,
    stat_layout: Layout | None,
    w_layout: Layout | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What :func:`_keep_for_grads` kept, with stand-ins for the rest: for a bias-only
    backward the gradient stands in for the input (no copy), one buffer for the statistics."""
    x, mean, rstd, weight = ctx.saved_tensors
    if x_layout is not None:
        x = standin(x_layout, grad=grad)
        mean = rstd = standin(stat_layout)  # type: ignore[arg-type]
    if w_layout is not None:
        weight = standin(w_layout)
    return x, mean, rstd, weight


class LayerNormFunction(torch.autograd.Function):
    """``aten.native_layer_norm`` keeping input and statistics only for the input/weight grads.

    Stock keeps them when only the bias is trainable too.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        normalized_shape: list[int],
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        need = ctx.needs_input_grad
        layouts = _keep_for_grads(ctx, x, mean, rstd, weight, need[0], need[2])
        ctx.meta = (layouts, normalized_shape, _layout_or_none(bias))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layouts, normalized_shape, b_layout = ctx.meta
        x, mean, rstd, weight = _restore_for_grads(ctx, grad, *layouts)
        # the bias is passed for its definedness and dtype only (stock passes the parameter)
        bias = None if b_layout is None else standin(b_layout)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3]]
        gx, gw, gb = aten.native_layer_norm_backward(
            grad, x, normalized_shape, mean, rstd, weight, bias, mask
        )
        return gx, None, gw, gb, None


def _as_shape(normalized_shape: int | Sequence[int]) -> list[int]:
    if isinstance(normalized_shape, int):
        return [normalized_shape]
    return [int(s) for s in normalized_shape]


def layer_norm_spares_nothing(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None
) -> bool:
    """Whether :class:`LayerNormFunction` would keep all stock keeps: the input and statistics
    (read by the input and weight gradients), the weight, and no bias but a Parameter (stock
    keeps the bias too, a reference)."""
    need_x = x.requires_grad
    need_w = weight is not None and weight.requires_grad
    return (
        (need_x or need_w)
        and (weight is None or need_x or isinstance(weight, nn.Parameter))
        and (bias is None or isinstance(bias, nn.Parameter))
    )


def layer_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm``: saves nothing when only the bias is trainable."""
    shape = _as_shape(normalized_shape)
    if not needs_graph(input, weight, bias) or layer_norm_spares_nothing(input, weight, bias):
        return F.layer_norm(input, shape, weight, bias, eps)
    out: torch.Tensor = apply(LayerNormFunction, input, shape, weight, bias, eps)
    return out


class GroupNormFunction(torch.autograd.Function):
    """``aten.native_group_norm`` keeping input and statistics only for the input/weight grads.

    Stock keeps them when only the bias is trainable too.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        num_groups: int,
        eps: float,
    ) -> torch.Tensor:
        n, c = x.shape[0], x.shape[1]
        hxw = math.prod(x.shape[2:])
        out, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, hxw, num_groups, eps)
        need = ctx.needs_input_grad
        ctx.meta = (
            _keep_for_grads(ctx, x, mean, rstd, weight, need[0], need[1]),
            (n, c, hxw, num_groups),
        )
        cpu = x.device.type == "cpu"
        ctx.memory_format = suggest_memory_format(x) if cpu else torch.contiguous_format
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        layouts, sizes = ctx.meta
        if grad.device.type != "xpu":  # as stock's NativeGroupNormBackward0: the input's
            grad = grad.contiguous(memory_format=ctx.memory_format)  # format on CPU
        mask = list(ctx.needs_input_grad[:3])
        # The CPU channels-last kernel (torch 2.13) reads the statistics and the weight and
        # writes the input gradient whatever the mask (stock segfaults there when the input
        # needs no grad): ask for the input gradient and drop it. The weight and bias
        # gradients do not depend on it.
        channels_last = ctx.memory_format != torch.contiguous_format
        x, mean, rstd, weight = _restore_for_grads(ctx, grad, *layouts)  # grad: in its format
        gx, gw, gb = aten.native_group_norm_backward(
            grad, x, mean, rstd, weight, *sizes, [mask[0] or channels_last, *mask[1:]]
        )
        return gx if mask[0] else None, gw, gb, None, None


def group_norm_spares_nothing(x: torch.Tensor) -> bool:
    """Whether :class:`GroupNormFunction` would keep all stock keeps (the input needs a
    gradient: input, statistics and weight are kept). Where only the weight trains it keeps
    the same too, but stock's channels_last CPU kernel crashes there (see its backward)."""
    return x.requires_grad


def group_norm(
    input: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.group_norm``: saves nothing when only the bias is trainable."""
    if not needs_graph(input, weight, bias) or group_norm_spares_nothing(input):
        return F.group_norm(input, num_groups, weight, bias, eps)
    if input.dim() < 2:
        raise RuntimeError(
            f"Expected at least 2 dimensions for input tensor but received {input.dim()}"
        )
    _verify_batch_size([input.size(0) * input.size(1) // num_groups, num_groups, *input.size()[2:]])
    channels = input.size(1)
    if channels % num_groups != 0:
        raise RuntimeError(
            "Expected number of channels in input to be divisible by num_groups, but got input "
            f"of shape {list(input.shape)} and num_groups={num_groups}"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.numel() != channels):
            raise RuntimeError(
                f"Expected {name} to be a vector of size equal to the number of channels in "
                f"input, but got {name} of shape {list(t.shape)} and input of shape "
                f"{list(input.shape)}"
            )
    # at::group_norm: the input in its suggested memory format on CPU, contiguous elsewhere
    if input.device.type == "cpu":
        x = input.contiguous(memory_format=suggest_memory_format(input))
    else:
        x = input.contiguous()
    w = None if weight is None else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    out: torch.Tensor = apply(GroupNormFunction, x, w, b, num_groups, eps)
    return out


class RMSNormFunction(torch.autograd.Function):
    """``F.rms_norm`` keeping only the input, in its own dtype.

    Stock's composite keeps a normalized copy beside the input (float32 upcasts of both for
    bf16/fp16). The backward re-runs stock's own forward under autograd and differentiates
    it, so every op and rounding is stock's (the cost: one recomputed forward).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        normalized_shape: list[int],
        weight: torch.Tensor | None,
        eps: float | None,
    ) -> torch.Tensor:
        out = F.rms_norm(x, normalized_shape, weight, eps)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        keep_w = weight is not None and (need_x or isinstance(weight, nn.Parameter))
        ctx.save_for_backward(
            x if need_x or need_w else None,
            weight if keep_w else None,
        )
        ctx.meta = (normalized_shape, eps, _layout_or_none(weight))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        normalized_shape, eps, w_layout = ctx.meta
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        if weight is None and w_layout is not None:
            weight = standin(w_layout)  # the weight gradient does not read the weight
        with torch.enable_grad():
            xd = x.detach().requires_grad_(need_x)
            wd = None if weight is None else weight.detach().requires_grad_(need_w)
            y = F.rms_norm(xd, normalized_shape, wd, eps)
            wanted = [t for t, need in ((xd, need_x), (wd, need_w)) if need]
            grads = list(torch.autograd.grad(y, wanted, grad))
        gx = grads.pop(0) if need_x else None
        gw = grads.pop(0) if need_w else None
        return gx, None, gw, None


def rms_norm(
    input: torch.Tensor,
    normalized_shape: int | Sequence[int],
    weight: torch.Tensor | None = None,
    eps: float | None = None,
) -> torch.Tensor:
    """``F.rms_norm``: keeps only the input, in its own dtype (stock keeps float32 copies)."""
    shape = _as_shape(normalized_shape)
    if not needs_graph(input, weight):
        return F.rms_norm(input, shape, weight, eps)
    out: torch.Tensor = apply(RMSNormFunction, input, shape, weight, eps)
    return out
