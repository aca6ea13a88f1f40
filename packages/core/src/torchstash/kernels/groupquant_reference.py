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
"""

from __future__ import annotations

import torch

from .reference import pack_bits_ref, philox_uniform_ref, unpack_bits_ref

__all__ = ["group_dequantize_ref", "group_quantize_ref", "levels", "num_groups"]

_LOW16 = 0xFFFF
_ULP16 = 0x10000


def num_groups(numel: int, group_size: int) -> int:
    return -(-numel // group_size)


def levels(bits: int, special: bool) -> int:
    """Highest code a finite value may take."""
    if not special:
        return (1 << bits) - 1
    return (1 << bits) - 4 if bits >= 2 else 0


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
    x: torch.Tensor, bits: int, group_size: int, seed: int, stochastic: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 codes, lo bf16[groups], step bf16[groups]) for float ``x``."""
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
    inf = torch.tensor(float("inf"), device=x.device)
    mn = torch.where(use, xp, inf).amin(dim=1)
    mx = torch.where(use, xp, -inf).amax(dim=1)
    empty = ~use.any(dim=1)
    # + 0.0 turns -0.0 into +0.0 (IEEE round-to-nearest): amin/amax pick either zero of a
    # group holding both, depending on the SIMD lane order.
    mn = torch.where(empty, torch.zeros_like(mn), mn) + 0.0
    mx = torch.where(empty, torch.zeros_like(mx), mx) + 0.0
    top = torch.where(
        special,
        torch.tensor(float(levels(bits, True)), device=x.device),
        torch.tensor(float(levels(bits, False)), device=x.device),
    )
    lo = bf16_down(mn)
    d = mx - lo
    step = torch.where(top > 0, bf16_up(d / torch.where(top > 0, top, 1.0)), 0.0)
    stored_step = torch.where(special, -step, step)

    if stochastic:
        u = philox_uniform_ref(n, seed, 0, device=x.device)
    else:
        u = torch.full((n,), 0.5, device=x.device)
    u = torch.nn.functional.pad(u, (0, pad)).view(g, group_size)
    lo_e, step_e, top_e = lo[:, None], step[:, None], top[:, None]
    safe_step = torch.where(step_e > 0, step_e, 1.0)
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
    return pack_bits_ref(q, bits), lo.to(torch.bfloat16), stored_step.to(torch.bfloat16)


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
    st = step.to(torch.float32)[gid]
    special = torch.signbit(st)
    val = lo.to(torch.float32)[gid] + codes.to(torch.float32) * st.abs()
    if bits >= 2:
        hi = (1 << bits) - 1
        val = torch.where(special & (codes == hi), float("nan"), val)
        val = torch.where(special & (codes == hi - 1), float("inf"), val)
        val = torch.where(special & (codes == hi - 2), float("-inf"), val)
    else:
        val = torch.where(special & (codes == 1), float("nan"), val)
    return val.to(dtype)
