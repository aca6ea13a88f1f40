"""``python -m torchstash_bench.quant``: the quant strategies on the bench zoo, measured.

For each zoo model and strategy: saved bytes against stock fp32 and against a bf16-autocast
stock step (exact accounting through ``torchstash.measure``), and the cosine similarity of
all parameter gradients to stock's on the same batch, in fp32 and under bf16 autocast (to
stock's under autocast). The figures in the package README
come from this command.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

import torchstash as ts
from torchstash.errors import PolicyError
from torchstash.policy import parse_spec
from torchstash.testing.models import ZooEntry, zoo

from .common import byte_counts, key, rows_table, write_rows, zoo_arguments

STRATEGIES = (
    "quant.int8",
    "quant.int4",
    "quant.int2",
    "quant.int1",
    "quant.auto",
    "quant.mesa",
    "quant.fp8",
)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _cosine(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(ref.double(), got.double(), dim=0))


def evaluate_one(entry: ZooEntry, strategy: str, batch: int | None = None) -> dict[str, Any]:
    x, y = entry.batch(batch or entry.batch_size, torch.device("cpu"))
    torch.manual_seed(0)
    model = entry.build()
    entry.loss(model, x, y).backward()
    ref = _grads(model).clone()

    def step() -> None:
        model.zero_grad()
        entry.loss(model, x, y).backward()

    # Two warm-up steps: running estimates (mesa) and allocations (auto) settle on the batch.
    name, options = parse_spec(strategy)
    report = ts.measure(model, step, name, warmup=2, repeat=1, **options)
    cosine = _cosine(ref, _grads(model))
    with torch.autocast("cpu", torch.bfloat16):
        step()
        ref_bf16 = _grads(model).clone()
        bf16 = ts.measure(model, step, name, warmup=2, repeat=1, **options)
    cosine_bf16 = _cosine(ref_bf16, _grads(model))
    return {
        "model": entry.name,
        "strategy": strategy,
        **byte_counts(report),
        "bf16_raw_bytes": bf16.raw_bytes,
        "ratio_fp32": report.raw_bytes / report.stored_bytes,
        "ratio_bf16": bf16.raw_bytes / bf16.stored_bytes,
        "grad_cosine": cosine,
        "grad_cosine_bf16": cosine_bf16,
    }


def evaluate(scale: str = "small", strategies: Sequence[str] = STRATEGIES) -> list[dict[str, Any]]:
    return [evaluate_one(e, s) for e in zoo(scale) for s in strategies]


def table(rows: list[dict[str, Any]], scale: str) -> Table:
    columns = [
        ("model", key("model")),
        ("strategy", key("strategy")),
        ("vs fp32", key("ratio_fp32", ".2f", "x")),
        ("vs bf16", key("ratio_bf16", ".2f", "x")),
        ("grad cosine", key("grad_cosine", ".4f")),
        ("bf16 cosine", key("grad_cosine_bf16", ".4f")),
    ]
    title = f"torchstash-quant on the bench zoo ({scale}), one step on CPU"
    return rows_table(title, columns, rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchstash_bench.quant")
    zoo_arguments(parser, STRATEGIES, " (quant.auto:budget=3)")
    args = parser.parse_args(argv)
    try:
        rows = evaluate(args.scale, args.strategies)
    except PolicyError as e:
        parser.error(str(e))
    Console().print(table(rows, args.scale))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
