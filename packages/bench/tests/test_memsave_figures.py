"""memsave's README figures, as ``python -m torchstash_bench.memsave`` and the bench measure
them: exact gradients, bytes never above stock's, on the zoo."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from torchstash.testing.models import zoo
from torchstash_bench import demo
from torchstash_bench.harness import run_bench
from torchstash_bench.memsave import PATTERNS, evaluate_one

ZOO = {e.name: e for e in zoo("tiny")}


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("model", ["resnet", "vit"])
def test_zoo_gradients_exact_and_bytes_at_most_stock(model: str, pattern: str) -> None:
    try:
        row = evaluate_one(ZOO[model], pattern, repeat=1)
    except ValueError:
        pytest.skip(f"{pattern} leaves nothing trainable in {model}")
    assert row["exact"], row
    assert row["memsave_bytes"] <= row["stock_bytes"], row
    if model == "resnet" and pattern in ("input", "norms", "conv-bn-eval", "input-bn-eval"):
        assert row["memsave_bytes"] < 0.8 * row["stock_bytes"], row


def test_bench_and_demo_count_against_stocks_bytes() -> None:
    """A rewriting strategy changes what the model saves: its ratio is against stock's."""

    rows = run_bench("tiny", ["memsave"], "cpu", repeat=1, console=Console(quiet=True))
    resnet = {r["strategy"]: r for r in rows if r["model"] == "resnet"}
    stock, ours = resnet["stock"], resnet["memsave"]
    assert ours["raw_bytes"] == stock["raw_bytes"]
    assert ours["ratio"] == pytest.approx(stock["raw_bytes"] / ours["stored_bytes"])
    assert ours["ratio"] > 1.1


def test_demo_reports_rewrites_that_saved_nothing(tmp_path: Any) -> None:

    console = Console(record=True, width=120, file=io.StringIO())
    result = demo.run_demo(
        steps=2, out_dir=tmp_path, strategies=["memsave"], quick=True, console=console
    )
    run = result.run("memsave")
    assert run.error is None and run.rewritten > 0
    assert run.losses == result.stock.losses  # exact
    assert "rewrote" in console.export_text()
