"""Golden model of e4m3 codes with a per-group scale (``fp8_quantize`` / ``fp8_dequantize``).

Bit-exact definition the CPU and CUDA kernels must reproduce (csrc/README.md repeats it):

* The tensor is flattened in row-major order of ``x.contiguous()``, read as float32 and
  padded with zeros to whole groups of ``group_size``.
* Per group: ``amax``, the largest finite magnitude (0 when none); *special* when it holds a
  NaN or an Inf. ``scale = bf16_up(amax / top)`` (float32 division; 1 when ``amax`` is 0),
  ``top`` 448 (the e4m3 maximum) or 240 for a special group, which leaves the codes with an
  all-ones exponent free: +Inf is 0x78, -Inf 0xF8, NaN 0x7F. Stored as bfloat16, negated
  for a special group.
* Code of a finite ``x``: ``clamp(x / scale, -448, 448)`` cast to ``float8_e4m3fn`` (round to
  nearest even). The clamp acts only where ``amax / top`` underflowed (a scale of 0 or too
  small: groups of values below about 1e-40), and makes those codes the same on every torch
  (from 2.10 its cast saturates; before, it gave NaN from 464 on). One byte per element; the
  padding's codes (0) are stored too, the codes of whole groups.
* Value: the e4m3 value times ``|scale|`` (float32); 0x78 / 0xF8 of a special group are
  +-Inf (0x7F is NaN by itself); then cast to the output dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .groupquant_reference import bf16_up

__all__ = ["E4M3", "NAN", "NEG_INF", "POS_INF", "fp8_dequantize_ref", "fp8_quantize_ref"]

E4M3 = torch.float8_e4m3fn
POS_INF, NEG_INF, NAN = 0x78, 0xF8, 0x7F


def fp8_quantize_ref(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)``: uint8 ``(ceil(n / group_size) * group_size,)`` and bfloat16
    ``(ceil(n / group_size),)``."""
    n, gs = x.numel(), group_size
    groups = -(-n // gs)
    v = F.pad(x.contiguous().reshape(-1).float(), (0, groups * gs - n)).view(groups, gs)
    finite = v.isfinite()
    special = ~finite.all(dim=1, keepdim=True)
    amax = torch.where(finite, v.abs(), 0.0).amax(dim=1, keepdim=True)
    top = torch.where(special, 240.0, 448.0)
    scale = bf16_up(torch.where(amax > 0, amax / top, 1.0))
    quotient = (torch.where(finite, v, 0.0) / scale).clamp(-448.0, 448.0)
    codes = quotient.to(E4M3).view(torch.uint8)
    codes = torch.where(v == float("inf"), POS_INF, codes)
    codes = torch.where(v == float("-inf"), NEG_INF, codes)
    codes = torch.where(v.isnan(), NAN, codes).to(torch.uint8)
    stored = torch.where(special, -scale, scale).to(torch.bfloat16).view(-1)
    return codes.view(-1), stored


def fp8_dequantize_ref(
    codes: torch.Tensor, scale: torch.Tensor, group_size: int, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """The 1-D ``dtype`` tensor of the ``numel`` values that :func:`fp8_quantize_ref` coded,
    from its first ``numel`` codes."""
    gid = torch.arange(numel, device=codes.device) // group_size
    s = scale.float()[gid]
    special = torch.signbit(s)
    val = codes.view(E4M3).float() * s.abs()
    val = torch.where(special & (codes == POS_INF), float("inf"), val)
    val = torch.where(special & (codes == NEG_INF), float("-inf"), val)
    return val.to(dtype)
