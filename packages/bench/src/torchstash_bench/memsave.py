"""``python -m torchstash_bench.memsave``: the figures in the package README, measured.

Models: memsave_torch's measured block (``block``) and the bench zoo. For each model and
fine-tuning pattern, one training step stock and one under ``memsave``
(exact accounting through ``torchstash.measure``; stock is counted by ``none`` on the same
model before the rewrite), the step-time ratio (median of ``--repeat`` steps, both in this
process), and a check that every gradient equals stock's bit for bit.

Patterns (what requires grad):
  ``all``        every parameter (training from scratch)
  ``input``      only the input (every parameter frozen: adversarial or input attribution)
  ``last``       only the last linear or conv layer (linear probing)
  ``norms``      only the normalization layers' affine parameters
  ``bn-eval``    every parameter, BatchNorm in eval mode (fine-tuning with frozen statistics)
  ``conv-bn-eval`` conv weights only, BatchNorm in eval mode
  ``input-bn-eval`` only the input, BatchNorm in eval mode (memsave_torch's "BN eval" case)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import torchstash as ts
from torchstash.testing.models import ZooEntry, zoo

from .common import key, megabytes, rows_table, write_rows, zoo_arguments

PATTERNS = ("all", "input", "last", "norms", "bn-eval", "conv-bn-eval", "input-bn-eval")
NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def set_pattern(model: nn.Module, pattern: str) -> bool:
    """Set ``requires_grad`` and train/eval for ``pattern``; True when the input needs grad."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern {pattern!r}: use one of {', '.join(PATTERNS)}")
    model.train()
    params = list(model.named_parameters())
    for _, p in params:
        p.requires_grad_(pattern in ("all", "bn-eval"))
    if pattern == "last":
        last = [m for m in model.modules() if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)][
            -1
        ]
        for p in last.parameters():
            p.requires_grad_(True)
    if pattern == "norms":
        for m in model.modules():
            if isinstance(m, NORMS):
                for p in m.parameters(recurse=False):
                    p.requires_grad_(True)
    if pattern == "conv-bn-eval":
        for m in model.modules():
            if isinstance(m, nn.modules.conv._ConvNd):
                m.weight.requires_grad_(True)
    if pattern in ("bn-eval", "conv-bn-eval", "input-bn-eval"):
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
    return pattern in ("input", "input-bn-eval")


def peers_block() -> ZooEntry:
    """memsave_torch's measured block: Conv-BN-ReLU-Conv-BN-ReLU-MaxPool on 8x16x32x32."""

    def build() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )

    def batch(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, 16, 32, 32, generator=g)
        return x.to(device), torch.randint(0, 16, (n, 16, 16), generator=g).to(device)

    return ZooEntry("block", build, batch, 8)


def _step(
    entry: ZooEntry, model: nn.Module, x: torch.Tensor, y: torch.Tensor, grad_x: bool
) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        inputs = x.detach().requires_grad_(grad_x) if x.is_floating_point() else x
        entry.loss(model, inputs, y).backward()

    return step


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def _median_ms(step: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def evaluate_one(
    entry: ZooEntry, pattern: str, repeat: int = 5, strategy: str = "memsave"
) -> dict[str, Any]:
    x, y = entry.batch(entry.batch_size, torch.device("cpu"))
    torch.manual_seed(0)
    model = entry.build()
    grad_x = set_pattern(model, pattern) and x.is_floating_point()
    step = _step(entry, model, x, y, grad_x)
    if not any(p.requires_grad for p in model.parameters()) and not grad_x:
        raise ValueError(f"pattern {pattern!r} leaves nothing trainable in {entry.name}")
    state = copy.deepcopy(model.state_dict())
    stock = ts.measure(model, step, "none", warmup=0, repeat=1)
    stock_grads = _grads(model)
    model.load_state_dict(state)  # BatchNorm's running statistics moved: start again
    stock_ms = _median_ms(step, repeat)
    model.load_state_dict(state)
    with ts.apply(model, strategy) as handle:
        step()
        ours_grads = _grads(model)
        model.load_state_dict(state)
        handle.tally.reset()
        step()
        tally = handle.tally
        stored = tally.stored_bytes
        model.load_state_dict(state)
        ours_ms = _median_ms(step, repeat)
        rewritten = len(handle.rewrites)
    exact = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(stock_grads, ours_grads, strict=True)
    )
    return {
        "model": entry.name,
        "pattern": pattern,
        "stock_bytes": stock.stored_bytes,
        "memsave_bytes": stored,
        "ratio": stored / stock.stored_bytes if stock.stored_bytes else 1.0,
        "time_ratio": ours_ms / stock_ms,
        "exact": exact,
        "rewritten": rewritten,
    }


def evaluate(
    scale: str = "small",
    patterns: Sequence[str] = PATTERNS,
    models: Sequence[str] = ("block", "resnet", "vit", "gpt"),
    repeat: int = 5,
) -> list[dict[str, Any]]:
    rows = []
    for entry in [peers_block(), *zoo(scale)]:
        if entry.name not in models:
            continue
        for pattern in patterns:
            try:
                rows.append(evaluate_one(entry, pattern, repeat))
            except ValueError as e:  # a pattern with nothing trainable in this model
                rows.append({"model": entry.name, "pattern": pattern, "skipped": str(e)})
    return rows


def table(rows: list[dict[str, Any]], scale: str) -> Table:
    columns = [
        ("model", key("model")),
        ("pattern", key("pattern")),
        ("stock MB", megabytes("stock_bytes")),
        ("memsave MB", megabytes("memsave_bytes")),
        ("saved", lambda r: f"{(r['ratio'] - 1) * 100:+.0f}%"),
        ("time", key("time_ratio", ".2f", "x")),
        ("grads", lambda r: "bit-exact" if r["exact"] else "DIFFER"),
    ]
    title = f"memsave on the bench zoo ({scale}), one step on CPU, against stock"
    return rows_table(title, columns, rows, failed="skipped")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstash_bench.memsave")
    zoo_arguments(parser)
    parser.add_argument("--patterns", default=",".join(PATTERNS))
    parser.add_argument("--models", default="block,resnet,vit,gpt")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps (median)")
    args = parser.parse_args(argv)
    patterns = [p for p in args.patterns.split(",") if p]
    for p in patterns:
        if p not in PATTERNS:
            parser.error(f"unknown pattern {p!r}; use {', '.join(PATTERNS)}")
    rows = evaluate(args.scale, patterns, args.models.split(","), args.repeat)
    Console().print(table(rows, args.scale))
    write_rows(args.json, rows)
    return 0 if all(r.get("exact", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
