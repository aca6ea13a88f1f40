"""The per-sample analysis: the exchange of widths it finds, and that it runs on the zoo."""

from __future__ import annotations

import pytest
import torch

from torchstash_bench.quant_persample import COST, best_exchange, gains


def test_equal_ranges_gain_nothing() -> None:
    assert best_exchange(torch.ones(64), 2) == 1.0


def test_one_wide_sample_beside_flat_ones_is_widened() -> None:
    r2 = torch.tensor([100.0, 1e-4, 1e-4, 1.0])
    got = best_exchange(r2, 2)
    expected = (100 * COST[4] + 2e-4 * COST[1] + 1.0 * COST[2]) / (float(r2.sum()) * COST[2])
    assert got == pytest.approx(expected)
    assert got < 0.1


def test_widths_without_a_neighbour_are_left_alone() -> None:
    assert best_exchange(torch.tensor([100.0, 1e-4, 1e-4]), 8) == 1.0
    assert best_exchange(torch.tensor([100.0, 1e-4, 1e-4]), 1) == 1.0


def test_runs_on_the_tiny_zoo() -> None:
    rows = gains("tiny", widths=(2,))
    assert {r["model"] for r in rows} == {"gpt", "vit", "resnet"}
    assert all(0 < float(r["best"]) <= float(r["mean"]) <= 1.0 for r in rows)  # type: ignore[arg-type]
