"""Derivative codes for GELU and SiLU: store a few bits of f'(x) instead of x (Few-Bit Backward).

The backward of an elementwise activation reads its saved input only through f'(x). So the
code is f'(x) rounded to one of ``2**bits - 1`` levels, and what unpacking restores is, for
each level, an input ``r`` with ``f'(r)`` equal to that level: stock autograd then computes
the coded derivative exactly, with no custom backward. Each ``r`` lies on the branch where f'
rises monotonically, so every level has one.

Rounding is stochastic by default: levels evenly spaced from the least to the greatest value
of f', and f'(x) rounded up with probability equal to its position between its two levels,
so the coded derivative is unbiased. Deterministic rounding (``stochastic=False``) goes to the
nearest of levels that minimize the squared error for inputs drawn from N(0, 1) (Lloyd-Max on
f'(X), Few-Bit Backward's choice): a smaller error, but a bias, which cost +0.9% final loss
at 4 bits in the demo.

The last code stands for a non-finite input, restored as NaN: stock PyTorch's derivative at
NaN and at +-Inf is NaN, so an overflow still reaches GradScaler.

Measured on N(0, sigma) inputs (sigma 0.5 to 3), the relative error of the derivative is
0.30-0.44 at 2 bits and 0.05-0.06 at 4 bits (deterministic: 0.12-0.24 and 0.03-0.04);
stochastic rounding of the input itself gives 0.41-0.63 and 0.09-0.20 at the same widths.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from torchstash.kernels import level_quantize, pack_bits, unpack_bits
from torchstash.layout import memory_order, restore
from torchstash.packed import Packed
from torchstash.seeds import SeedStream
from torchstash.site import Site

#: Ops whose saved input is read in backward only through their derivative.
DERIV_OPS = frozenset({"gelu", "silu"})
#: Ops whose saved input is read in backward only through their derivative and whose output
#: the engine recomputes from it: coded as values at ``act_bits`` (the derivative codes above
#: are for GELU and SiLU only: MobileNetV3's Hardswish has a piecewise-linear derivative).
ACT_OPS = DERIV_OPS | {"hardswish"}
#: Widths a derivative code can take (one code is kept for non-finite inputs).
DERIV_BITS = (2, 4, 8)
CODEC = "quant.deriv"

_GRID_HALF_WIDTH = 8.0
_GRID_POINTS = 16001
_LLOYD_ITERATIONS = 100


def derivative(op: str, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """f'(x) as stock autograd computes it, in ``x``'s dtype."""
    one = torch.ones((), dtype=x.dtype, device=x.device).expand_as(x)
    if op == "gelu":
        return torch.ops.aten.gelu_backward(one, x, approximate=approximate)
    if op == "silu":
        return torch.ops.aten.silu_backward(one, x)
    raise ValueError(f"no derivative code for op {op!r}; known: {sorted(DERIV_OPS)}")


@dataclass(frozen=True)
class DerivTable:
    """Levels of f' a code can take, the inputs that restore them, and the cuts between."""

    levels: torch.Tensor  # float64, ascending, distinct: up to 2**bits - 1 of them
    inputs: torch.Tensor  # 2**bits, in the target dtype: code i restores inputs[i]; the last NaN
    cuts: torch.Tensor  # midpoints between levels, in the target dtype
    #: the levels as float32 on the table's device, for stochastic rounding
    device_levels: torch.Tensor


def _lloyd_levels(d: torch.Tensor, w: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` levels minimizing the w-weighted squared error of rounding ``d``."""
    order = d.argsort()
    cdf = w[order].cumsum(0) / w.sum()
    quantiles = (torch.arange(count, dtype=d.dtype) + 0.5) / count
    levels = d[order][torch.searchsorted(cdf, quantiles).clamp(max=d.numel() - 1)]
    for _ in range(_LLOYD_ITERATIONS):
        index = torch.bucketize(d, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(count, dtype=d.dtype).index_add_(0, index, w)
        total = torch.zeros(count, dtype=d.dtype).index_add_(0, index, w * d)
        levels = torch.where(mass > 0, total / mass.clamp(min=1e-300), levels).sort().values
    return levels


def _solve_on_rising_branch(
    op: str, approximate: str, levels: torch.Tensor, lo: float, hi: float
) -> torch.Tensor:
    """For each level, the x in [lo, hi] (where f' rises) with f'(x) = level, by bisection."""
    a = torch.full_like(levels, lo)
    b = torch.full_like(levels, hi)
    for _ in range(80):
        mid = (a + b) / 2
        below = derivative(op, mid, approximate) < levels
        a = torch.where(below, mid, a)
        b = torch.where(below, b, mid)
    return (a + b) / 2


@functools.lru_cache(maxsize=64)
def _table_cpu(
    op: str, approximate: str, bits: int, dtype: torch.dtype, stochastic: bool
) -> DerivTable:
    grid = torch.linspace(-_GRID_HALF_WIDTH, _GRID_HALF_WIDTH, _GRID_POINTS, dtype=torch.float64)
    d = derivative(op, grid, approximate)
    lo, hi = float(grid[d.argmin()]), float(grid[d.argmax()])
    if stochastic:  # evenly spaced, ends included: every value lies between two levels
        # (measured: optimizing the inner levels for N(0, 1) lowers the variance by 0-6%)
        wanted = torch.linspace(float(d.min()), float(d.max()), 2**bits - 1, dtype=torch.float64)
    else:
        wanted = _lloyd_levels(d, torch.exp(-grid * grid / 2), 2**bits - 1)
    # Inputs in the target dtype, and the levels they really give there (stock's kernel).
    inputs = _solve_on_rising_branch(op, approximate, wanted, lo, hi).to(dtype)
    levels = derivative(op, inputs, approximate).to(torch.float64)
    # At 8 bits in half precision, neighbouring inputs can round to one value: keep one each.
    levels, first = _unique_sorted(levels)
    inputs = inputs[first]
    cuts = ((levels[1:] + levels[:-1]) / 2).to(dtype)
    # Index 2**bits - 1 is the non-finite code; slots no level took are never coded.
    pad = inputs[-1:].expand(2**bits - 1 - inputs.numel())
    nan = torch.full((1,), math.nan, dtype=dtype)
    return DerivTable(levels, torch.cat([inputs, pad, nan]), cuts, levels.float())


def _unique_sorted(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values ascending, and the index of one occurrence of each."""
    values, order = values.sort()
    keep = torch.ones_like(values, dtype=torch.bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep], order[keep]


_on_device: dict[tuple[str, str, int, torch.dtype, torch.device, bool], DerivTable] = {}


def table(
    op: str,
    bits: int,
    dtype: torch.dtype,
    device: torch.device,
    approximate: str = "none",
    stochastic: bool = True,
) -> DerivTable:
    """The code table for ``op`` at ``bits``, built once per dtype and kept on ``device``."""
    key = (op, approximate, bits, dtype, device, stochastic)
    hit = _on_device.get(key)
    if hit is None:
        cpu = _table_cpu(op, approximate, bits, dtype, stochastic)
        hit = DerivTable(
            cpu.levels, cpu.inputs.to(device), cpu.cuts.to(device), cpu.device_levels.to(device)
        )
        _on_device[key] = hit
    return hit


def current_approximate(site: Site) -> str:
    """The GELU variant the op at ``site`` was called with (``"none"`` or ``"tanh"``)."""
    if site.op != "gelu":
        return "none"
    return str(site.opcall.argument("approximate", 1, "none"))


def pack_derivative(
    x: torch.Tensor, op: str, bits: int, approximate: str = "none", seed: int | None = None
) -> Packed:
    """``x``'s derivative code: rounded stochastically with Philox keyed by ``seed``, or to the
    nearest level when ``seed`` is None (the two use different level tables)."""
    stochastic = seed is not None
    t = table(op, bits, x.dtype, x.device, approximate, stochastic)
    xm, order = memory_order(x.detach())  # coded in memory order: a permuted input (ConvNeXt's
    d = derivative(op, xm, approximate)  # channels-last GELU) needs no copy, keeps its strides
    if seed is not None:  # one kernel pass (levels kept on the device: no copy per tensor)
        packed = level_quantize(d, t.device_levels, bits, seed=seed)
    else:
        codes = torch.bucketize(d, t.cuts, out_int32=True)
        codes = codes.masked_fill_(d.isnan(), 2**bits - 1).to(torch.uint8)
        packed = pack_bits(codes, bits)
    p = Packed.like(x, CODEC, codes=packed)
    p.meta.update(op=op, bits=bits, approximate=approximate, stochastic=stochastic, order=order)
    return p


def unpack_derivative(packed: Packed) -> torch.Tensor:
    op, bits, approximate = packed.meta["op"], packed.meta["bits"], packed.meta["approximate"]
    assert isinstance(op, str) and isinstance(bits, int) and isinstance(approximate, str)
    codes = packed.tensors["codes"]
    assert isinstance(codes, torch.Tensor)
    stochastic = bool(packed.meta.get("stochastic", False))
    t = table(op, bits, packed.dtype, packed.device, approximate, stochastic)
    index = unpack_bits(codes, bits, packed.numel).to(torch.int32)
    order = packed.meta.get("order")
    values = t.inputs.index_select(0, index)  # a 1-D gather: 4x what indexing takes
    return restore(values, packed.shape, order if isinstance(order, tuple) else None)


class DerivCoder:
    """Derivative codes at ``bits`` for the GELU/SiLU inputs an ``OpAware`` meets."""

    def __init__(self, bits: int, stochastic: bool = True, seed: int | None = None) -> None:
        self.bits = bits
        self.stochastic = bool(stochastic)
        self.seeds = SeedStream(seed)

    def pack(self, x: torch.Tensor, site: Site) -> Packed:
        seed = self.seeds.next() if self.stochastic else None
        return pack_derivative(x, site.op, self.bits, current_approximate(site), seed)

    def unpack(self, packed: Packed) -> torch.Tensor:
        return unpack_derivative(packed)
