"""ReLU, LeakyReLU, Hardtanh and ReLU6 that save a 1-bit mask instead of a float tensor.

Stock keeps the output (ReLU), the input (LeakyReLU, Hardtanh) or a full clone of the input
(in-place Hardtanh/ReLU6, whose derivative reads the original values) for a gradient that
depends on one bit per element. The masks follow stock's backward exactly, NaN included
(measured on CPU, torch 2.13):

* ReLU: ``threshold_backward(g, out, 0)`` zeroes where ``out <= 0``: keep ``~(out <= 0)``
  (a NaN keeps its gradient), the core's sign bits (:mod:`torchstash.signs`): one kernel
  pass finds and packs them, and one computes the gradient from them
  (:func:`~torchstash.signs.sign_gradient`, which reads an eighth of what stock's reads);
* LeakyReLU: ``leaky_relu_backward`` is ``x > 0 ? g : g * slope``: keep ``x > 0`` (NaN gets
  ``g * slope``);
* Hardtanh/ReLU6: ``hardtanh_backward`` keeps the gradient strictly inside the bounds
  (compared in float32 for bf16/fp16). For NaN its CPU kernel answers 0 in its vectorized
  loop and the gradient in its scalar tail, so which one depends on where the NaN lies in
  memory. The backward therefore runs that kernel itself on a tensor laid out like the input
  with the same answers and NaN at the same places; on CPU the NaN positions are saved as a
  second 1-bit mask, only when the input has any.

The bits are packed in memory order, so a channels_last mask unpacks channels_last and the
gradient has stock's strides. For LeakyReLU and Hardtanh the backward kernel reads the mask
cast to the gradient's dtype (through uint8: a bool cast is slow) and writes its result over
it (:func:`_into`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from torchstash.opmark import as_op, engine_active, tracking
from torchstash.signs import SignBits, sign_bits, sign_gradient

from ._standin import as_uint8, check_inplace, needs_graph, pack_keep_mask, unpack_keep_mask
from ._tracker import apply, untracked

__all__ = [
    "MaskedActivationFunction",
    "hardtanh",
    "leaky_relu",
    "relu",
    "relu6",
]

aten = torch.ops.aten


def _bound(value: float, dtype: torch.dtype, *, down: bool) -> float:
    """A bound in ``dtype`` that compares with ``dtype`` values as ``value`` does in float32.

    ``hardtanh_backward`` compares bf16/fp16 inputs in float32 against the bounds rounded to
    float32; comparing in the input's dtype rounds the bound to nearest instead (0.7 becomes
    0.69921875 in bf16, and the input 0.69921875 would lose its gradient). Rounding the bound
    down (lower bound) or up (upper bound) to the dtype gives the same answers.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return value
    exact = torch.tensor(value, dtype=torch.float32)
    bound = exact.to(dtype)
    if (bound.float() > exact) if down else (bound.float() < exact):
        bound = torch.nextafter(bound, torch.tensor(-math.inf if down else math.inf, dtype=dtype))
    return float(bound)


def _hardtanh_masks(
    x: torch.Tensor, a: float, b: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(where the gradient passes, where x is NaN or None) for ``hardtanh_backward``."""
    low, high = _bound(a, x.dtype, down=True), _bound(b, x.dtype, down=False)
    if x.device.type != "cpu":  # CUDA only: a scalar kernel, a NaN passes its gradient
        return ~((x <= low) | (x >= high)), None
    nan = x.isnan()
    return (x > low) & (x < high), (nan if bool(nan.any()) else None)


def _hardtanh_values(
    keep: torch.Tensor, nan: torch.Tensor | None, a: float, grad: torch.Tensor
) -> torch.Tensor:
    """Values laid out like the input that ``hardtanh_backward`` answers as it did for it.

    The lower bound where the gradient is zeroed, the next value of the dtype above it where it
    passes (strictly inside the bounds whenever any input was), NaN where the input was NaN.
    """
    low = torch.tensor(_bound(a, grad.dtype, down=True), dtype=grad.dtype, device=grad.device)
    nan_value = torch.tensor(math.nan, dtype=grad.dtype, device=grad.device)
    if grad.device.type != "cpu":  # CUDA only: NaN passes the gradient there
        return torch.where(keep, nan_value, low)
    inside = torch.nextafter(low, torch.tensor(math.inf, dtype=grad.dtype, device=grad.device))
    values = torch.where(keep, inside, low)
    return values if nan is None else torch.where(nan, nan_value, values)


class MaskedActivationFunction(torch.autograd.Function):
    """ReLU (``kind='relu'``), LeakyReLU (``'leaky_relu'``, slope ``a``) or Hardtanh
    (``'hardtanh'``, bounds ``a``, ``b``), out of place or in place, saving 1 bit per element.

    Stock saves a float tensor of the input's size (a clone of it for in-place Hardtanh).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, kind: str, a: float, b: float, inplace: bool
    ) -> torch.Tensor:
        need = ctx.needs_input_grad[0]
        keep: torch.Tensor | None = None
        nan: torch.Tensor | None = None
        if kind == "relu":
            out = torch.relu_(x) if inplace else torch.relu(x)
        elif kind == "leaky_relu":
            if need:
                keep = x > 0
            out = F.leaky_relu(x, a, inplace)
        elif kind == "hardtanh":
            if need:
                keep, nan = _hardtanh_masks(x, a, b)
            out = F.hardtanh(x, a, b, inplace)
        else:
            raise ValueError(f"unknown activation kind {kind!r}")
        if inplace:
            ctx.mark_dirty(x)
            out = x  # the same tensor; named as the input so torch.compile sees it returned
        if not need:
            ctx.save_for_backward(None, None)
            return out
        if kind == "relu":  # the output's sign bits in one pass: ~(out <= 0), NaN kept
            bits, inverse = sign_bits(out)
            nan_bits = None
        else:
            assert keep is not None
            bits, inverse = pack_keep_mask(keep)
            nan_bits = None if nan is None else pack_keep_mask(nan)[0]
        ctx.save_for_backward(bits, nan_bits)
        ctx.meta = (tuple(x.shape), inverse, kind, a, b)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        bits, nan_bits = ctx.saved_tensors
        shape, inverse, kind, a, b = ctx.meta
        if kind == "relu":
            return sign_gradient(grad, bits, shape, inverse), None, None, None, None
        keep = unpack_keep_mask(bits, shape, inverse)
        if kind == "leaky_relu":
            gx = _into(aten.leaky_relu_backward, grad, as_uint8(keep).to(grad.dtype), a, False)
        else:
            nan = None if nan_bits is None else unpack_keep_mask(nan_bits, shape, inverse)
            values = _hardtanh_values(keep, nan, a, grad)
            gx = _into(aten.hardtanh_backward, grad, values, a, b)
        return gx, None, None, None, None


def _into(op: Any, grad: torch.Tensor, values: torch.Tensor, *args: Any) -> torch.Tensor:
    """``op(grad, values, *args)`` written over ``values``, a temporary of this backward, where
    it is laid out as ``grad`` is (then so is the result stock's kernel would allocate): one
    full-size buffer per backward, as stock's, not two (a fresh CPU buffer of this size costs
    page faults). Each element of the result reads only the same element of ``values``."""
    if values.shape == grad.shape and values.stride() == grad.stride():
        out: torch.Tensor = op.grad_input(grad, values, *args, grad_input=values)
        return out
    result: torch.Tensor = op(grad, values, *args)
    return result


def _apply(x: torch.Tensor, kind: str, a: float, b: float, inplace: bool) -> torch.Tensor:
    if inplace:
        check_inplace(x)
    out: torch.Tensor = apply(MaskedActivationFunction, x, kind, a, b, inplace)
    return out


class ReLUMask(SignBits):
    """The core's sign code (:class:`torchstash.signs.SignBits`: the same bits, the same
    record, the same 1.0/0.0 restored, one kernel pass each way) under the name of memsave's
    ReLU code, for what only a ReLU's output is given."""


#: The engine's code for a ReLU output: 1 bit per element, decoded as 1.0 (kept) or 0.0.
#:
#: Under torchstash's engine the ReLU is stock's op, whose saved float output is named op
#: ``memsave.relu``, whose default code this is (registered by the plug-in, overridable by a
#: policy rule naming that op), instead of packing the bits itself: when the next layer saves
#: the same tensor as it is (a conv whose weight trains), the engine drops the code and both
#: read that one tensor, so the ReLU costs nothing beside it and never more than stock. Stock's
#: backward reads the restored 1.0/0.0 as it would the output. It is the core's shared sign
#: codec, the same quant's op-aware codes use, found faster (:class:`ReLUMask`).
RELU_MASK = ReLUMask("memsave.relu_mask")
#: the name memsave's ReLU gives its saves under the engine; its default code is ``RELU_MASK``
RELU_OP = "memsave.relu"


def relu(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu`` saving a 1-bit mask (stock: the float output).

    Under torchstash's engine the mask is the engine's code of the output, which yields to
    the output itself where another op saves it as is (see :data:`RELU_MASK`).
    """
    if not (input.requires_grad and torch.is_grad_enabled()):
        return F.relu(input, inplace)
    if engine_active():
        # stock's op, whose saved output the engine codes as op memsave.relu (RELU_MASK); the
        # tracker off, which would name the save as a stock ReLU's. Every ReLU of a replayed
        # forward passes here, the tracker off already: nothing more than the name.
        with as_op("relu", (input,), func=RELU_OP):
            if not tracking():
                return F.relu(input, inplace)
            with untracked():
                return F.relu(input, inplace)
    return _apply(input, "relu", 0.0, 0.0, inplace)


def leaky_relu(
    input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False
) -> torch.Tensor:
    """``F.leaky_relu`` saving a 1-bit mask (stock: the float input or output).

    In place with a negative slope, stock refuses the backward; this one computes it.
    """
    if not needs_graph(input):
        return F.leaky_relu(input, negative_slope, inplace)
    return _apply(input, "leaky_relu", float(negative_slope), 0.0, inplace)


def hardtanh(
    input: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False
) -> torch.Tensor:
    """``F.hardtanh`` saving a 1-bit mask (stock: the float input, a clone of it in place)."""
    if not needs_graph(input):
        return F.hardtanh(input, min_val, max_val, inplace)
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    return _apply(input, "hardtanh", float(min_val), float(max_val), inplace)


def relu6(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``F.relu6``, which is ``hardtanh(0, 6)`` in ATen, saving a 1-bit mask."""
    if not needs_graph(input):
        return F.relu6(input, inplace)
    return _apply(input, "hardtanh", 0.0, 6.0, inplace)
