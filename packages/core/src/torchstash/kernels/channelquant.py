"""Public channel-wise ("head-wise") 8-bit quantization: the compiled kernel when it can run, else the reference.

The layout of ``quant.mesa``: one float32 ``lo`` and ``step`` per channel (a head of a
(B, H, N, D) attention tensor, a channel of an activation), chosen by the caller from
:func:`channel_minmax`, and one uint8 code per element: 0..252 for finite values, rounded
stochastically (unbiased), 253/254/255 for -Inf/+Inf/NaN. Each op is one pass over the
tensor instead of the dozen full-size passes of the pure-PyTorch formulas. The bit-exact
definition is :mod:`torchstash.kernels.channelquant_reference` (and csrc/README.md); the
rounding uniforms are ``philox_uniform(numel, seed, 0)``, as for ``group_quantize``.

Channels: the flat tensor (``x.contiguous()`` order) is read as ``(numel / (inner * C), C,
inner)``, so element ``i`` belongs to channel ``(i // inner) % C``; ``numel`` must be a
multiple of ``inner * C``. For a contiguous (B, H, N, D) tensor per head, ``inner = N * D``
and ``C = H``; for a (B, N, C) tensor per channel, ``inner = 1``.
"""

from __future__ import annotations

import torch

from ._checks import (
    as_int64,
    check_bytes,
    check_count,
    check_flag,
    check_float_dtype,
    check_float_tensor,
    check_tensor,
    check_u64,
)
from ._dispatch import Impl, dispatch, use_kernel
from .channelquant_reference import (
    channel_dequantize_ref,
    channel_minmax_ref,
    channel_quantize_ref,
    mesa_quantize_ref,
)

__all__ = ["channel_dequantize", "channel_minmax", "channel_quantize", "mesa_quantize"]

_INNER_HINT = (
    "it is the number of consecutive elements of one channel: N * D for the heads of a "
    "contiguous (B, H, N, D) tensor, 1 for the last dim"
)


def _check_layout(numel: int, inner: int, channels: int, what: str, *, op: str) -> None:
    if numel % inner or (numel // inner) % channels:
        raise ValueError(
            f"{op}: {what} has {numel} elements, not a multiple of inner * channels "
            f"({inner} * {channels}); pass the inner and channel count of its layout"
        )


def _check_params(
    lo: object, step: object, owner: torch.Tensor, owner_name: str, *, op: str
) -> int:
    """lo and step: float32, 1-D, one entry per channel, on the owner's device."""
    for t, name in ((lo, "lo"), (step, "step")):
        t = check_tensor(t, name, op=op)
        if t.dtype != torch.float32:
            raise TypeError(
                f"{op}: {name} must be float32, got {t.dtype}; convert it with .float()"
            )
        if t.dim() != 1 or t.numel() < 1:
            raise ValueError(
                f"{op}: {name} must be 1-D with one entry per channel, got shape {tuple(t.shape)}"
            )
        if t.device != owner.device:
            raise ValueError(
                f"{op}: {name} is on {t.device} but {owner_name} is on {owner.device}; "
                "keep the three tensors on one device"
            )
    assert isinstance(lo, torch.Tensor) and isinstance(step, torch.Tensor)
    if lo.numel() != step.numel():
        raise ValueError(
            f"{op}: lo and step must have one entry per channel each, got "
            f"{lo.numel()} and {step.numel()}"
        )
    return lo.numel()


def channel_minmax(
    x: torch.Tensor, inner: int, channels: int, *, impl: Impl = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)``: float32 ``(channels,)`` over each channel's finite elements of ``x``
    (any shape and strides, ``x.contiguous()`` order); ``+inf`` / ``-inf`` where a channel
    has no finite element, ``+0.0`` for a zero minimum or maximum."""
    op = "channel_minmax"
    x = check_float_tensor(x, "x", op=op)
    check_count(inner, "inner", op=op, hint=_INNER_HINT)
    check_count(channels, "channels", op=op, hint="one per head or channel")
    _check_layout(x.numel(), inner, channels, "x", op=op)
    return dispatch("channel_minmax", impl, x.device, channel_minmax_ref, x, inner, channels)


def channel_quantize(
    x: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    inner: int,
    *,
    seed: int,
    stochastic: bool = True,
    impl: Impl = "auto",
) -> torch.Tensor:
    """1-D uint8 codes of ``x`` (float, any shape and strides; ``x.contiguous()`` order), one
    per element, with float32 ``lo`` and ``step`` of shape ``(C,)``.

    ``seed`` in [0, 2**64) picks the rounding uniforms; ``stochastic=False`` rounds to nearest.
    """
    op = "channel_quantize"
    x = check_float_tensor(x, "x", op=op)
    check_count(inner, "inner", op=op, hint=_INNER_HINT)
    channels = _check_params(lo, step, x, "x", op=op)
    _check_layout(x.numel(), inner, channels, "x", op=op)
    check_u64(seed, "seed", op=op)
    check_flag(stochastic, "stochastic", op=op)
    if use_kernel(impl, x.device):
        codes: torch.Tensor = torch.ops.torchstash.channel_quantize(
            x, lo, step, inner, as_int64(seed), stochastic
        )
        return codes
    return channel_quantize_ref(x, lo, step, inner, seed, stochastic)


def mesa_quantize(
    x: torch.Tensor,
    inner: int,
    channels: int,
    groups: int,
    running: torch.Tensor | None,
    decay: float,
    *,
    seed: int,
    stochastic: bool = True,
    impl: Impl = "auto",
    checked: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quant.mesa``'s pack in one call: ``(codes, lo, step, run)``.

    The channels' finite range (:func:`channel_minmax`), taken per group of channels (channel
    ``c`` in group ``c * groups // channels``), blended into the ``running`` range (float32
    ``(2, groups)``: the lows, then the highs; None starts one) with ``decay``, widened to this
    tensor's range; ``lo`` and ``step`` per group; the codes as :func:`channel_quantize` makes
    them with each channel's group's. One pass for the range and one for the codes, where the
    dozen PyTorch ops on the small vectors between them cost more than the passes on a small
    tensor. ``checked=False`` leaves the arguments to the compiled op's own checks (a codec's
    call, once per saved tensor).
    """
    op = "mesa_quantize"
    if checked:
        x = check_float_tensor(x, "x", op=op)
        check_count(inner, "inner", op=op, hint=_INNER_HINT)
        check_count(channels, "channels", op=op, hint="one per head or channel")
        check_count(groups, "groups", op=op, hint="at most one per channel")
        if groups > channels:
            raise ValueError(f"{op}: groups ({groups}) must be at most channels ({channels})")
        _check_layout(x.numel(), inner, channels, "x", op=op)
        if running is not None:
            running = check_tensor(running, "running", op=op)
            if running.dtype != torch.float32 or tuple(running.shape) != (2, groups):
                raise ValueError(
                    f"{op}: running must be float32 of shape (2, {groups}), got "
                    f"{running.dtype} {tuple(running.shape)}; pass the range the last call "
                    "returned, or None"
                )
            if running.device != x.device:
                raise ValueError(
                    f"{op}: running is on {running.device} but x is on {x.device}; "
                    "keep both on one device"
                )
        check_u64(seed, "seed", op=op)
        check_flag(stochastic, "stochastic", op=op)
    if use_kernel(impl, x.device):
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = (
            torch.ops.torchstash.mesa_quantize(
                x, inner, channels, groups, running, float(decay), as_int64(seed), stochastic
            )
        )
        return out
    return mesa_quantize_ref(x, inner, channels, groups, running, decay, seed, stochastic)


def channel_dequantize(
    codes: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    inner: int,
    dtype: torch.dtype,
    *,
    impl: Impl = "auto",
    checked: bool = True,
) -> torch.Tensor:
    """The 1-D ``dtype`` tensor of ``codes.numel()`` values that :func:`channel_quantize`
    encoded (NaN and Inf back where they were). ``checked=False``: as for
    :func:`mesa_quantize`, for the codec that made the codes."""
    op = "channel_dequantize"
    if checked:
        codes = check_bytes(codes, "codes", "channel_quantize", op=op)
        check_count(inner, "inner", op=op, hint=_INNER_HINT)
        channels = _check_params(lo, step, codes, "codes", op=op)
        _check_layout(codes.numel(), inner, channels, "codes", op=op)
        check_float_dtype(dtype, "dtype", op=op)
    args = (codes, lo, step, inner, dtype)
    return dispatch("channel_dequantize", impl, codes.device, channel_dequantize_ref, *args)
