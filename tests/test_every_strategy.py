"""Every installed strategy, on every zoo model: the day a strategy is registered, it is tested here.

Each one must train (finite gradients), never store more than stock PyTorch, and -- if it says it
is lossless -- give gradients equal to stock bit for bit.
"""

from __future__ import annotations

import gc
import importlib
import weakref

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


@pytest.fixture(scope="module")
def imports_done() -> None:
    """torch's compiler imported first: the first apply in a process imports it, and that
    import keeps its callers' frames (the apply's, with the model) in a reference cycle once,
    which is torch's doing, not the library's."""
    importlib.import_module("torch._dynamo")


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_removed_model_is_freed_without_the_garbage_collector(
    imports_done: None, strategy: str, model_name: str
) -> None:
    """After remove(), dropping the model frees it (its weights, on a GPU) at once: nothing of
    the library keeps it in a reference cycle that waits for the garbage collector (the
    engine's parameter reader held it strongly, and the engine sits in a cycle)."""
    entry = MODELS[model_name]
    x, y = entry.batch(4, torch.device("cpu"))
    model = entry.build()
    gc.collect()
    gc.disable()
    try:
        handle = ts.apply(model, strategy)
        for _ in range(3):  # recorded, then replayed
            entry.loss(model, x, y).backward()
        handle.remove()
        gone = weakref.ref(model)
        del model, handle
        assert gone() is None, f"{strategy} kept {model_name} alive after remove()"
    finally:
        gc.enable()
