"""Every installed strategy, on every zoo model: the day a strategy is registered, it is tested here.

Each one must train (finite gradients), never store more than stock PyTorch, and -- if it says it
is lossless -- give gradients equal to stock bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash.testing.models import zoo

STRATEGIES = ts.REGISTRY.names()
MODELS = {e.name: e for e in zoo("tiny")}


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_trains_and_saves_no_more_than_stock(strategy: str, model_name: str) -> None:
    entry = MODELS[model_name]
    x, y = entry.batch(4, torch.device("cpu"))
    torch.manual_seed(0)
    stock = entry.build()
    entry.loss(stock, x, y).backward()
    torch.manual_seed(0)
    model = entry.build()
    report = ts.measure(
        model, lambda: entry.loss(model, x, y).backward(), strategy, repeat=1, warmup=0
    )
    got = _grads(model)
    assert got and all(g.isfinite().all() for g in got)
    assert report.stored_bytes <= report.raw_bytes, (report.stored_bytes, report.raw_bytes)
    if ts.REGISTRY.get(strategy).lossless:
        assert all(torch.equal(a, b) for a, b in zip(_grads(stock), got))


def test_registry_is_not_empty() -> None:
    assert {"none", "offload.cpu"} <= set(STRATEGIES)
