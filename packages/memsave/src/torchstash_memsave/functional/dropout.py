"""Dropout and AlphaDropout that save the keep mask as bits instead of a float noise tensor.

On CPU, stock ``at::dropout`` computes ``x * noise`` with a float ``noise`` of the input's size
and autograd keeps that noise for the backward; on CUDA the fused ``native_dropout`` keeps a
bool mask (a byte per element). Either way one bit per element is information enough.

The forward runs stock's own ops in stock's order (``empty_like(x).bernoulli_(1 - p)`` and so
on), so it consumes the random generator exactly as stock does and the outputs are identical;
the backward rebuilds the noise from the bits with the same ops.

Feature dropout (``Dropout1d/2d/3d``, ``FeatureAlphaDropout``) is left out on purpose: its
noise has one element per (sample, channel), so stock already saves next to nothing.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._standin import as_uint8, check_inplace, needs_graph, pack_keep_mask, unpack_keep_mask
from ._tracker import apply

__all__ = ["DropoutFunction", "alpha_dropout", "dropout"]

aten = torch.ops.aten

_ALPHA = 1.7580993408473766  # at::native's alpha_dropout constant


def _alpha_coefficients(p: float) -> tuple[float, float]:
    """(a, alpha * a) of ``_dropout_impl``: the noise is scaled by ``a``, shifted by ``b``."""
    a = 1.0 / math.sqrt((_ALPHA * _ALPHA * p + 1) * (1 - p))
    return a, _ALPHA * a


def _fused(x: torch.Tensor) -> bool:
    """ATen's ``is_fused_kernel_acceptable`` (0 < p < 1 and numel > 0 checked by the caller)."""
    kind = x.device.type
    return kind in ("cuda", "xpu", "lazy") or kind == torch._C._get_privateuse1_backend_name()


class DropoutFunction(torch.autograd.Function):
    """Dropout (``alpha=False``) or AlphaDropout (``alpha=True``) with 0 < p < 1, training.

    Stock keeps a float noise tensor (a bool mask on CUDA) of the input's size.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float, alpha: bool, inplace: bool) -> torch.Tensor:
        need = ctx.needs_input_grad[0]
        fused = not alpha and not inplace and _fused(x)
        if fused:
            # CUDA (and other fused devices): native_dropout returns the mask itself
            out, mask = aten.native_dropout(x, p, True)
            bits, inverse = pack_keep_mask(mask) if need else (None, None)
        else:
            # _dropout_impl<feature=false>: the same ops in the same order as stock
            noise = torch.empty_like(x).bernoulli_(1 - p)
            # the noise is 0.0 or 1.0 here: nonzero by a cast (a comparison is some 8x slower)
            bits, inverse = pack_keep_mask(noise.bool()) if need else (None, None)
            shift = None
            if alpha:
                a, alpha_a = _alpha_coefficients(p)
                shift = noise.add(-1).mul_(alpha_a).add_(alpha_a * p)
                noise.mul_(a)
            else:
                noise.div_(1 - p)
            out = x.mul_(noise) if inplace else x * noise
            del noise
            if shift is not None:
                out.add_(shift)
        if inplace:
            ctx.mark_dirty(x)
        ctx.save_for_backward(bits)
        ctx.meta = (tuple(x.shape), inverse, p, alpha, fused)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (bits,) = ctx.saved_tensors
        shape, inverse, p, alpha, fused = ctx.meta
        keep = unpack_keep_mask(bits, shape, inverse)
        if fused:
            return aten.native_dropout_backward(grad, keep, 1.0 / (1.0 - p)), None, None, None
        noise = as_uint8(keep).to(grad.dtype)
        if alpha:
            noise.mul_(_alpha_coefficients(p)[0])
        else:
            noise.div_(1 - p)
        return grad * noise, None, None, None


def _dropout(x: torch.Tensor, p: float, training: bool, inplace: bool, alpha: bool) -> torch.Tensor:
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not needs_graph(x):
        fn = F.alpha_dropout if alpha else F.dropout
        return fn(x, p, training, inplace)
    # _dropout_impl: the identity, and a multiplication by zero for p == 1
    if p == 0 or not training or x.numel() == 0:
        return x
    if p == 1:
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        return x.mul_(zero) if inplace else x * zero
    if inplace:
        check_inplace(x)
    out: torch.Tensor = apply(DropoutFunction, x, p, alpha, inplace)
    return out


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` saving the keep mask at 1 bit per element (stock: a float noise tensor)."""
    return _dropout(input, p, training, inplace, alpha=False)


def alpha_dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = False, inplace: bool = False
) -> torch.Tensor:
    """``F.alpha_dropout`` saving the keep mask at 1 bit per element (stock: a float noise)."""
    return _dropout(input, p, training, inplace, alpha=True)
