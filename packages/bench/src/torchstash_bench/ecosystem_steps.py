"""A strategy's gradient along stock's training run, on the models users bring.

A first step says little of a strategy that adapts (``quant.auto`` allocates from its second
step, re-allocates every ``interval``): stock trains with SGD, and at each step every
strategy's gradient is taken at stock's weights on the same batch, so each step's cosine is
against the gradient stock used. ``python -m torchstash_bench.ecosystem_steps --models
timm-efficientnet_b0 --strategies quant.int2,quant.auto`` prints, per strategy, the cosine
at step 1 and over the later steps (least, median, most), and stock's saved bytes over the
strategy's at the last step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from typing import Any

import torch

from torchstash.api import apply
from torchstash.policy import parse_spec

from .common import key, rows_table, split_names
from .ecosystem import MODELS, Unavailable, closeness, fresh, gradients, library, loss_at


def along_stock(
    name: str, strategies: Sequence[str], steps: int, lr: float
) -> list[dict[str, Any]]:
    """One row per strategy on model ``name``: the cosines of ``steps`` steps."""
    spec = MODELS[name]
    stock = fresh(spec)
    models = [fresh(spec) for _ in strategies]
    specs = [parse_spec(s) for s in strategies]  # "quant.auto:budget=3"
    handles = [apply(m, n, **o) for m, (n, o) in zip(models, specs, strict=True)]
    sgd = torch.optim.SGD(stock.parameters(), lr=lr)
    cosines: list[list[float]] = [[] for _ in strategies]
    ratios = [0.0] * len(strategies)
    try:
        for step in range(steps):
            sgd.zero_grad(set_to_none=True)
            loss_at(spec, stock, step).backward()
            want = gradients(stock)
            for i, (model, handle) in enumerate(zip(models, handles, strict=True)):
                model.load_state_dict(stock.state_dict())
                model.zero_grad(set_to_none=True)
                handle.tally.reset()
                loss_at(spec, model, step).backward()
                cosines[i].append(closeness(want, gradients(model))[0])
                ratios[i] = handle.tally.raw_bytes / max(handle.tally.stored_bytes, 1)
            sgd.step()
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    for strategy, got, ratio in zip(strategies, cosines, ratios, strict=True):
        later = got[2:] or got[-1:]
        rows.append(
            {
                "model": name,
                "strategy": strategy,
                "first": got[min(1, len(got) - 1)],
                "least": min(later),
                "median": statistics.median(later),
                "most": max(later),
                "ratio": ratio,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torchstash_bench.ecosystem_steps", description=__doc__
    )
    p.add_argument("--models", type=split_names, default=["timm-efficientnet_b0"])
    p.add_argument("--strategies", type=split_names, default=["quant.int2", "quant.auto"])
    p.add_argument("--steps", type=int, default=22, help="SGD steps of stock (default 22)")
    p.add_argument("--lr", type=float, default=0.01, help="stock's SGD rate (default 0.01)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default: 1)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    torch.set_num_threads(args.threads)
    from rich.console import Console

    console = Console(highlight=False, width=max(Console().width, 100))
    rows: list[dict[str, Any]] = []
    for name in args.models:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        try:
            library(MODELS[name].library)
        except Unavailable as e:
            console.print(f"{name}: skipped, {e}")
            continue
        rows += along_stock(name, args.strategies, args.steps, args.lr)
    columns = [
        ("model", key("model")),
        ("strategy", key("strategy")),
        ("step 1", key("first", ".2f")),
        ("least", key("least", ".2f")),
        ("median", key("median", ".2f")),
        ("most", key("most", ".2f")),
        ("ratio", key("ratio", ".1f", "x")),
    ]
    title = f"gradient cosine to stock at stock's weights, steps 2 to {args.steps - 1} (SGD)"
    console.print(rows_table(title, columns, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
