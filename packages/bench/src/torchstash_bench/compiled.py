"""A strategy inside torch.compile's graph against compiled stock, and eagerly against stock.

    python -m torchstash_bench.compiled                   # the zoo at --scale small, inductor
    python -m torchstash_bench.compiled --scale tiny --backend aot_eager --steps 3
    python -m torchstash_bench.compiled --budget 0.5   # both compiled with that memory budget

Per zoo model, four ways taking turns in one process, one thread (in shuffled rounds of a
few steps each: :mod:`torchstash_bench.turns`): compiled
stock, the strategy compiled (in the graph where its codes trace: ``torchstash.graphhooks``),
eager stock, the strategy eagerly. Prints each step's median over its stock's, and the saved
bytes the tally counts over raw (compiled: what the graph's hooks coded), and the strategy's
compiled bytes over its eager bytes. ``--budget`` compiles stock with that
``activation_memory_budget`` and the strategy with ``apply(..., compile_budget=)``: inductor's
partitioner recomputes the cheapest values, the strategy codes the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

import torchstash as ts
from torchstash.testing.models import zoo

from .turns import turns


def _step(
    name: str,
    run: tuple[torch.nn.Module, Any],
    entry: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    budget: float | None,
) -> float:
    """One training step of ``run`` (the model, and what to call), timed; compiled stock's
    under the memory budget when one is given."""
    model, call = run
    model.zero_grad(set_to_none=True)
    patch = (
        torch._functorch.config.patch(activation_memory_budget=budget)
        if budget is not None and name == "compiled stock"
        else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with patch:
        entry.loss(call, x, y).backward()
    return time.perf_counter() - start


def measure(
    scale: str,
    strategy: str,
    backend: str,
    steps: int,
    warmup: int,
    budget: float | None = None,
) -> list[dict[str, Any]]:
    rows = []
    for entry in zoo(scale):
        torch._dynamo.reset()
        torch.manual_seed(0)
        base = entry.build()
        x, y = entry.batch(entry.batch_size, torch.device("cpu"))
        stock, ours, eager = (copy.deepcopy(base) for _ in range(3))
        graphed = ts.apply(ours, strategy, compile_budget=budget)
        eagerly = ts.apply(eager, strategy)
        runs = {
            "compiled stock": (stock, torch.compile(stock, backend=backend)),
            "compiled": (ours, torch.compile(ours, backend=backend)),
            "stock": (base, base),
            "eager": (eager, eager),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(warmup):
                for name, run in runs.items():
                    _step(name, run, entry, x, y, budget)
            for name, timed in turns(list(runs), steps):  # shuffled rounds, blocks of steps
                spent = _step(name, runs[name], entry, x, y, budget)
                if timed:
                    times[name].append(spent)
        median = {k: statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "model": entry.name,
                "in graph": graphed.graph is not None,
                "compiled stock ms": median["compiled stock"] * 1e3,
                "compiled x": median["compiled"] / median["compiled stock"],
                "stock ms": median["stock"] * 1e3,
                "eager x": median["eager"] / median["stock"],
                "compiled saved": graphed.tally.stored_bytes / max(1, graphed.tally.raw_bytes),
                "eager saved": eagerly.tally.stored_bytes / max(1, eagerly.tally.raw_bytes),
                # both counted over the same steps
                "compiled/eager bytes": graphed.tally.stored_bytes
                / max(1, eagerly.tally.stored_bytes),
            }
        )
        graphed.remove()
        eagerly.remove()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", default="small", help="the zoo's scale (default: small)")
    parser.add_argument("--strategy", default="quant.int8")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--budget", type=float, default=None, help="activation_memory_budget of both compiles"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.scale, args.strategy, args.backend, args.steps, args.warmup, args.budget)
    for row in rows:
        print(
            f"{row['model']}: {args.strategy} compiled {row['compiled x']:.2f}x compiled stock "
            f"({row['compiled stock ms']:.1f} ms{'' if row['in graph'] else ', eagerly'}), "
            f"eager {row['eager x']:.2f}x stock ({row['stock ms']:.1f} ms); saved/raw "
            f"compiled {row['compiled saved']:.3f}, eager {row['eager saved']:.3f}; compiled "
            f"bytes {row['compiled/eager bytes']:.2f}x eager's"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
