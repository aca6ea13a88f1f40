"""``python -m torchstash_bench.quant_persample``: what widths chosen per sample would gain.

ActNN's L3 gives each sample of a tensor its own width, from the sample's range. With
stochastic rounding a sample's error is about ``R**2 * c(b)`` (``R`` its range, ``c`` the
per-width factor below), so moving bits between samples pays only where ranges differ a lot:
our codes come in widths 1, 2, 4 and 8, and widening one sample from 2 to 4 bits must be paid
for by narrowing two to 1 bit, which pays only when their ranges are below about a fifth of
the widened one's. This tool takes every saved activation of one step of each bench-zoo
model, finds the best exchange of widths between its samples (dim 0) at the same average,
and reports the estimated error against one width for the whole tensor.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch
from rich.console import Console

from torchstash.testing.models import zoo

from .common import key, rows_table, zoo_arguments

#: Error factor per width, relative to ``R**2`` (1 bit: the levels are the group's ends).
COST = {1: 1.3, 2: 1 / 9, 4: 1 / 225, 8: 1 / 65025}
WIDER = {1: 2, 2: 4, 4: 8}
NARROWER = {2: 1, 4: 2, 8: 4}


def best_exchange(range_sq: torch.Tensor, width: int) -> float:
    """Least estimated error over uniform ``width``'s, widening the widest-range samples and
    narrowing the narrowest-range ones so that the average width stays ``width``."""
    up, down = WIDER.get(width), NARROWER.get(width)
    uniform = float(range_sq.sum()) * COST[width]
    if up is None or down is None or uniform == 0:
        return 1.0
    r = range_sq.sort(descending=True).values.double()
    prefix = torch.cat([r.new_zeros(1), r.cumsum(0)])
    n, per = r.numel(), (up - width) / (width - down)
    best = uniform
    for k in range(1, n):
        m = math.ceil(k * per)
        if k + m > n:
            break
        high, low = float(prefix[k]), float(prefix[n] - prefix[n - m])
        middle = float(prefix[n - m] - prefix[k])
        best = min(best, high * COST[up] + low * COST[down] + middle * COST[width])
    return best / uniform


def gains(scale: str = "small", widths: Sequence[int] = (2, 4)) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for entry in zoo(scale):
        x, y = entry.batch(entry.batch_size, torch.device("cpu"))
        torch.manual_seed(0)
        model = entry.build()
        ranges: list[torch.Tensor] = []

        def pack(t: torch.Tensor, ranges: list[torch.Tensor] = ranges) -> torch.Tensor:
            if t.is_floating_point() and t.dim() >= 2 and t.numel() >= 4096 and not t.is_leaf:
                flat = t.detach().reshape(t.shape[0], -1).float()
                ranges.append((flat.amax(1) - flat.amin(1)).square())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = entry.loss(model, x, y)
        loss.backward()
        for width in widths:
            ratios = torch.tensor([best_exchange(r, width) for r in ranges])
            rows.append(
                {
                    "model": entry.name,
                    "width": width,
                    "tensors": len(ranges),
                    "mean": float(ratios.mean()),
                    "best": float(ratios.min()),
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstash_bench.quant_persample")
    zoo_arguments(parser)
    args = parser.parse_args(argv)
    columns = [
        ("model", key("model")),
        ("width", key("width")),
        ("tensors", key("tensors")),
        ("mean", key("mean", ".3f")),
        ("best tensor", key("best", ".3f")),
    ]
    title = "per-sample widths: estimated error over one width per tensor (1 = no gain)"
    Console().print(rows_table(title, columns, gains(args.scale), left=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
