"""Golden model of channel-wise ("head-wise") 8-bit quantization, the layout of ``quant.mesa``.

Bit-exact definition the CPU and CUDA kernels must reproduce (csrc/README.md repeats it):

* The tensor is flattened in row-major order of ``x.contiguous()`` and read as
  ``(n / (inner * C), C, inner)``: element ``i`` belongs to channel ``(i // inner) % C``.
  ``n`` must be a multiple of ``inner * C`` (every channel run is whole).
* ``channel_minmax``: per channel, the float32 minimum and maximum of its finite elements
  (``+inf`` and ``-inf`` when it has none), with ``-0.0`` returned as ``+0.0``.
* ``channel_quantize`` with float32 ``lo``, ``step`` (one per channel), all in float32 with
  round-to-nearest and no fused multiply-add: a finite ``v`` gets
  ``clamp(floor(s + u), 0, 252)`` with ``s = (v - lo) / step`` where ``step > 0`` and
  ``s = 0`` otherwise (a NaN ``s + u`` gives code 0), ``u`` the element's Philox uniform
  (``philox_uniform(n, seed, 0)[i]``) or 0.5 without stochastic rounding. NaN, +Inf and -Inf
  get the reserved codes 255, 254 and 253. One uint8 code per element (no packing).
* ``mesa_quantize`` (``quant.mesa``'s pack, one call): the channels' ``channel_minmax``,
  reduced to ``groups`` groups (channel ``c`` in group ``c * groups // C``: the minimum of its
  channels' minima, the maximum of their maxima), the running range updated from it
  (``run = where(seen, decay * running + (1 - decay) * observed, running)`` with ``seen``
  where the group's minimum <= maximum, the scalars rounded to float32; ``where(seen,
  observed, 0)`` without a running range), ``lo = minimum(run_lo, min)``, ``step =
  clamp_min(maximum(run_hi, max) - lo, 0) / 252``, then ``channel_quantize`` with each
  channel's group's ``lo`` and ``step``. Returns the codes, ``lo``, ``step`` and ``run``.
* ``channel_dequantize``: ``lo + code * step`` (fp32 multiply, then add), the reserved codes
  mapped back to NaN, +Inf and -Inf, then cast to the output dtype (round to nearest even).

These are the formulas ``MesaQuantizer`` has always used (``where(step > 0, (v - lo) /
where(step > 0, step, 1), 0)``, ``floor(scaled + u)``, ``clamp(0, 252)``), so moving it
onto the kernels changed none of its codes.
"""

from __future__ import annotations

import torch

from .reference import philox_uniform_ref

__all__ = [
    "LEVELS",
    "NAN_CODE",
    "NEG_INF_CODE",
    "POS_INF_CODE",
    "channel_dequantize_ref",
    "channel_index",
    "channel_minmax_ref",
    "channel_quantize_ref",
    "group_of_channel",
    "mesa_quantize_ref",
]

#: The highest code of a finite value, and the codes reserved for the non-finite ones.
LEVELS = 252
NEG_INF_CODE, POS_INF_CODE, NAN_CODE = 253, 254, 255


def channel_index(
    numel: int, inner: int, channels: int, device: torch.device | str
) -> torch.Tensor:
    """The channel of every flat element, ``(i // inner) % channels`` (int64)."""
    return torch.arange(numel, device=device) // inner % channels


def _as_3d(t: torch.Tensor, inner: int, channels: int) -> torch.Tensor:
    return t.contiguous().reshape(-1, channels, inner)


def channel_minmax_ref(
    x: torch.Tensor, inner: int, channels: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) float32 of each channel's finite elements; +inf / -inf for none."""
    if x.numel() == 0:
        return (
            torch.full((channels,), float("inf"), device=x.device),
            torch.full((channels,), float("-inf"), device=x.device),
        )
    v = _as_3d(x, inner, channels).to(torch.float32)
    finite = v.isfinite()
    mn = torch.where(finite, v, float("inf")).amin(dim=(0, 2))
    mx = torch.where(finite, v, float("-inf")).amax(dim=(0, 2))
    # + 0.0 turns -0.0 into +0.0: amin/amax pick either zero of a channel holding both.
    return mn + 0.0, mx + 0.0


def channel_quantize_ref(
    x: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    inner: int,
    seed: int,
    stochastic: bool = True,
) -> torch.Tensor:
    """1-D uint8 codes of float ``x`` with float32 ``lo``/``step`` per channel."""
    n, channels = x.numel(), lo.numel()
    v = _as_3d(x, inner, channels).to(torch.float32)
    lo_c = lo.to(torch.float32).view(1, channels, 1)
    step_c = step.to(torch.float32).view(1, channels, 1)
    positive = step_c > 0
    scaled = torch.where(positive, (v - lo_c) / torch.where(positive, step_c, 1.0), 0.0)
    if stochastic:
        u = philox_uniform_ref(n, seed, 0, device=x.device).view(v.shape)
        q = torch.floor(scaled + u)
    else:
        q = torch.floor(scaled + 0.5)
    q = q.clamp(0, LEVELS)
    # A NaN quotient (inf / inf, or inf - inf) is code 0 explicitly: NaN -> uint8 is undefined.
    codes = torch.where(q.isnan(), 0.0, q).to(torch.uint8)
    codes = torch.where(v.isnan(), NAN_CODE, codes)
    codes = torch.where(v == float("inf"), POS_INF_CODE, codes)
    codes = torch.where(v == float("-inf"), NEG_INF_CODE, codes)
    return codes.to(torch.uint8).reshape(-1)


def channel_dequantize_ref(
    codes: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    inner: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The 1-D tensor of ``codes.numel()`` values in ``dtype`` that the codes stand for."""
    channels = lo.numel()
    c = _as_3d(codes, inner, channels)
    val = lo.to(torch.float32).view(1, channels, 1) + c.to(torch.float32) * step.to(
        torch.float32
    ).view(1, channels, 1)
    val = torch.where(c == NAN_CODE, float("nan"), val)
    val = torch.where(c == POS_INF_CODE, float("inf"), val)
    val = torch.where(c == NEG_INF_CODE, float("-inf"), val)
    return val.to(dtype).reshape(-1)


def group_of_channel(channels: int, groups: int, device: torch.device | str) -> torch.Tensor:
    """Each channel's group, ``c * groups // channels`` (int64)."""
    return torch.arange(channels, device=device) * groups // channels


def mesa_quantize_ref(
    x: torch.Tensor,
    inner: int,
    channels: int,
    groups: int,
    running: torch.Tensor | None,
    decay: float,
    seed: int,
    stochastic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, lo, step, run)``: ``quant.mesa``'s pack of ``x`` in ``groups`` channel groups,
    its running range ``running`` ((2, groups) float32, or None) updated with ``decay``."""
    gmin, gmax = channel_minmax_ref(x, inner, channels)
    gid = None
    if groups != channels:
        gid = group_of_channel(channels, groups, x.device)
        gmin = torch.full((groups,), float("inf"), device=x.device).scatter_reduce(
            0, gid, gmin, "amin"
        )
        gmax = torch.full((groups,), float("-inf"), device=x.device).scatter_reduce(
            0, gid, gmax, "amax"
        )
    seen = gmin <= gmax
    observed = torch.stack((gmin, gmax))
    if running is None:
        run = torch.where(seen, observed, 0.0)
    else:
        run = torch.where(seen, decay * running + (1 - decay) * observed, running)
    lo = torch.minimum(run[0], gmin)
    step = (torch.maximum(run[1], gmax) - lo).clamp_(min=0.0).div_(LEVELS)
    lo_c, step_c = (lo, step) if gid is None else (lo[gid], step[gid])
    codes = channel_quantize_ref(x, lo_c, step_c, inner, seed, stochastic)
    return codes, lo, step, run
