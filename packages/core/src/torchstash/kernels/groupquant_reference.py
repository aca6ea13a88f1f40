"""Golden model of fused per-group quantization (``group_quantize`` / ``group_dequantize``).

Bit-exact definition the CPU and CUDA kernels must reproduce (csrc/README.md repeats it):

* The tensor is flattened in row-major order of ``x.contiguous()``; group ``g`` holds
  elements ``[g * G, min((g + 1) * G, n))`` (``G = group_size``); codes are packed with
  the bitpack layout (element ``i`` at bit ``i * bits``), continuous across groups.
* Per group, over its finite elements: ``mn``, ``mx`` (both 0 when none is finite), with
  ``-0.0`` read as ``+0.0`` (which zero a SIMD min/max returns for a group holding both
  depends on the lane order, so it is canonicalized). A group holding a NaN or an Inf is
  *special*.
* Levels ``L``: ``2**bits - 1`` for a normal group. A special group reserves codes for the
  non-finite values: ``2**bits - 1`` = NaN, ``2**bits - 2`` = +Inf, ``2**bits - 3`` = -Inf
  (bits >= 2, leaving ``L = 2**bits - 4``); at 1 bit, code 1 = NaN (any non-finite) and
  ``L = 0``. So NaN and Inf come back where they were, with no host synchronisation.
* ``lo = bf16_down(mn)`` (largest bfloat16 <= mn); ``step = bf16_up((mx - lo) / L)`` in
  fp32 (0 when ``L == 0``); both stored as bfloat16; a special group stores ``-step``
  (sign bit set, ``-0.0`` included).
* Code of a finite ``x``: ``clamp(floor((x - lo) / step + u), 0, L)`` in fp32 with
  round-to-nearest and no fused multiply-add (0 when ``step == 0``, and 0 when the quotient
  is NaN, i.e. ``inf / inf`` with an infinite ``lo`` or ``step``), ``u`` the element's
  Philox uniform (``philox_uniform(n, seed, 0)[i]``), or 0.5 without stochastic rounding.
  With ``u`` uniform, ``E[lo + code * step] = x``: unbiased.
* Dequantization: ``lo + code * step`` (fp32 multiply, then add; no FMA), the special codes
  mapped back, then cast to the output dtype (round to nearest even).
* A *tiny* group: one whose finite values are all subnormal, not all zero (largest finite
  magnitude ``M`` with ``0 < M < 2**-126``). Its ``lo`` and ``step`` would be bfloat16
  subnormals, multiples of ``2**-133``: about two significant bits for ``randn * 1e-40``.
  So it is coded scaled by ``2**126`` (exact for a subnormal): from the scaled ``mn``, ``mx``
  its shape is *positive* (``mn >= 0``: ``width = mx``), *negative* (``mx <= 0``:
  ``width = -mn``) or *both* (``width = 2 * max(-mn, mx)``); ``step = bf16_up(width / L)``
  (0 when ``L == 0``) and, with ``span = L * step`` (exact), ``lo = 0``, ``0 - span`` or
  ``0 - span * 0.5``: zero is a level of a one-signed group. Stored: ``step`` as any group's;
  ``lo`` as the bfloat16 NaN pattern ``0x7F80 | shape`` (1, 2, 3), which no other group
  stores, and from which with ``step`` and ``L`` its ``lo`` is recomputed. Codes of the
  scaled values, as above; values ``(lo + code * step) * 2**-126`` (one more rounding, to
  float32's subnormals), then as above.
"""

from __future__ import annotations

import torch

from .reference import Seed, pack_bits_ref, philox_uniform_ref, unpack_bits_ref

__all__ = ["group_dequantize_ref", "group_quantize_ref", "group_steps", "levels", "num_groups"]

#: Below this largest finite magnitude (float32's smallest normal) a group is *tiny*.
TINY = 2.0**-126
#: A tiny group's values are coded multiplied by this (exact: they are subnormal).
TINY_SCALE = 2.0**126
#: A tiny group's ``lo`` is stored as this bfloat16 NaN pattern, or'ed with its shape.
TINY_LO = 0x7F80
POSITIVE, NEGATIVE, BOTH = 1, 2, 3

_LOW16 = 0xFFFF
_ULP16 = 0x10000


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def levels(bits: int, special: bool) -> int:
    """Highest code a finite value may take."""
    if not special:
        return (1 << bits) - 1
    return (1 << bits) - 4 if bits >= 2 else 0


def _tiny_lo(shape: torch.Tensor, top: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """A tiny group's scaled ``lo`` from its shape, levels and scaled step: 0 (positive),
    ``-span`` (negative) or ``-span / 2`` (both), ``span = top * step`` (exact)."""
    span = top * step
    half = torch.where(shape == NEGATIVE, span, span * 0.5)
    return torch.where(shape == POSITIVE, torch.zeros_like(span), torch.zeros_like(span) - half)


def _tiny_params(
    mn: torch.Tensor, mx: torch.Tensor, top: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shape, scaled lo, scaled step) of tiny groups whose finite values span [mn, mx]."""
    smn, smx = mn * TINY_SCALE, mx * TINY_SCALE
    shape = torch.where(mn >= 0, POSITIVE, torch.where(mx <= 0, NEGATIVE, BOTH))
    both = 2.0 * torch.maximum(-smn, smx)
    width = torch.where(shape == POSITIVE, smx, torch.where(shape == NEGATIVE, -smn, both))
    step = torch.where(top > 0, bf16_up(width / torch.where(top > 0, top, 1.0)), 0.0)
    return shape, _tiny_lo(shape, top, step), step


def _bits32(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _from_bits32(b: torch.Tensor) -> torch.Tensor:
    b = torch.where(b >= 1 << 31, b - (1 << 32), b)
    return b.to(torch.int32).view(torch.float32)


def bf16_down(v: torch.Tensor) -> torch.Tensor:
    """The largest bfloat16 value <= v (as float32); v finite."""
    b = _bits32(v)
    trunc = b & ~_LOW16 & 0xFFFFFFFF  # toward zero: down for v >= 0, up for v < 0
    inexact = (b & _LOW16) != 0
    out = torch.where(inexact & (v < 0), trunc + _ULP16, trunc)
    return _from_bits32(out)


def bf16_up(v: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= v (as float32); v finite or +inf."""
    b = _bits32(v)
    trunc = b & ~_LOW16 & 0xFFFFFFFF
    inexact = (b & _LOW16) != 0
    out = torch.where(inexact & (v > 0), trunc + _ULP16, trunc)
    return _from_bits32(out)


def group_quantize_ref(
    x: torch.Tensor, bits: int, group_size: int, seed: Seed, stochastic: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 codes, lo bf16[groups], step bf16[groups]) for float ``x``. With the seed
    a tensor (:data:`~.reference.Seed`) it traces into ``torch.compile``'s graph with the seed
    an input, and inductor's code gives the kernel's bits (``test_traced_reference.py``)."""
    n = x.numel()
    g = num_groups(n, group_size)
    xf = x.contiguous().reshape(-1).to(torch.float32)
    pad = g * group_size - n
    xp = torch.nn.functional.pad(xf, (0, pad)).view(g, group_size)
    valid = torch.ones(g * group_size, dtype=torch.bool, device=x.device)
    if pad:
        valid[n:] = False
    valid = valid.view(g, group_size)
    finite = xp.isfinite()
    use = finite & valid
    special = (~finite & valid).any(dim=1)
    # 0-dim values made by ops (torch.full), not tensor constants: a graph the reference is
    # traced into as a saved-tensor hook (torchstash.graphhooks) holds no constants
    inf = torch.full((), float("inf"), device=x.device)
    mn = torch.where(use, xp, inf).amin(dim=1)
    mx = torch.where(use, xp, -inf).amax(dim=1)
    empty = ~use.any(dim=1)
    # + 0.0 turns -0.0 into +0.0 (IEEE round-to-nearest): amin/amax pick either zero of a
    # group holding both, depending on the SIMD lane order.
    mn = torch.where(empty, torch.zeros_like(mn), mn) + 0.0
    mx = torch.where(empty, torch.zeros_like(mx), mx) + 0.0
    top = torch.where(
        special,
        torch.full((), float(levels(bits, True)), device=x.device),
        torch.full((), float(levels(bits, False)), device=x.device),
    )
    lo = bf16_down(mn)
    d = mx - lo
    step = torch.where(top > 0, bf16_up(d / torch.where(top > 0, top, 1.0)), 0.0)
    big = torch.maximum(-mn, mx)
    tiny = (big > 0) & (big < TINY)
    shape, lo_t, step_t = _tiny_params(mn, mx, top)
    lo_bits = torch.where(tiny, TINY_LO | shape, lo.to(torch.bfloat16).view(torch.int16))
    lo, step = torch.where(tiny, lo_t, lo), torch.where(tiny, step_t, step)
    stored_step = torch.where(special, -step, step)

    if stochastic:
        u = philox_uniform_ref(n, seed, 0, device=x.device)
    else:
        u = torch.full((n,), 0.5, device=x.device)
    u = torch.nn.functional.pad(u, (0, pad)).view(g, group_size)
    lo_e, step_e, top_e = lo[:, None], step[:, None], top[:, None]
    safe_step = torch.where(step_e > 0, step_e, 1.0)
    xp = torch.where(tiny[:, None], xp * TINY_SCALE, xp)
    v = torch.where(step_e > 0, (xp - lo_e) / safe_step, 0.0)
    q = torch.floor(v + u)
    q = torch.minimum(torch.clamp(q, min=0.0), top_e)
    # A NaN quotient (inf / inf) is code 0 explicitly: NaN -> uint8 is undefined behaviour.
    q = torch.where(finite & ~q.isnan(), q, 0.0).to(torch.uint8)
    if bits >= 2:
        hi = (1 << bits) - 1
        q = torch.where(xp.isnan(), hi, q)
        q = torch.where(xp == float("inf"), hi - 1, q)
        q = torch.where(xp == float("-inf"), hi - 2, q)
    else:
        q = torch.where(finite, q, 1)
    q = q.to(torch.uint8).reshape(-1)[:n]
    stored_lo = lo_bits.to(torch.int16).view(torch.bfloat16)
    return pack_bits_ref(q, bits), stored_lo, stored_step.to(torch.bfloat16)


def _tiny_groups(lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which groups are tiny (their stored ``lo`` a NaN pattern, which no other group stores),
    and every stored ``lo``'s 16 bits."""
    lo_bits = lo.view(torch.int16).to(torch.int32) & _LOW16
    return (lo_bits & 0x7FFF) > TINY_LO, lo_bits


def _loaded_lo(
    lo: torch.Tensor, step: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which groups are tiny (their stored ``lo`` a NaN pattern, which no other group
    stores), and every group's ``lo`` in float32: a tiny one's recomputed from its shape."""
    tiny, lo_bits = _tiny_groups(lo)
    st = step.to(torch.float32)
    top = torch.where(torch.signbit(st), float(levels(bits, True)), float(levels(bits, False)))
    return tiny, torch.where(tiny, _tiny_lo(lo_bits & 0x7F, top, st.abs()), lo.float())


def group_steps(lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Each group's rounding step in the values' own scale (float32, >= 0; 0 for a group
    stored exactly): a tiny group's stored step is its scaled one (see the definition above).
    What a caller that models the codes' noise from the steps reads."""
    tiny, _ = _tiny_groups(lo)
    st = step.float().clamp_min(0)
    return torch.where(tiny, st * TINY, st)


def group_dequantize_ref(
    packed: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    bits: int,
    group_size: int,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The 1-D tensor of ``numel`` values in ``dtype`` that :func:`group_quantize_ref` encoded."""
    codes = unpack_bits_ref(packed, bits, numel).to(torch.int64)
    gid = torch.arange(numel, device=packed.device) // group_size
    tiny, lo_f = _loaded_lo(lo, step, bits)
    st = step.to(torch.float32)[gid]
    special = torch.signbit(st)
    val = lo_f[gid] + codes.to(torch.float32) * st.abs()
    val = torch.where(tiny[gid], val * TINY, val)
    if bits >= 2:
        hi = (1 << bits) - 1
        val = torch.where(special & (codes == hi), float("nan"), val)
        val = torch.where(special & (codes == hi - 1), float("inf"), val)
        val = torch.where(special & (codes == hi - 2), float("-inf"), val)
    else:
        val = torch.where(special & (codes == 1), float("nan"), val)
    return val.to(dtype)
