"""No host synchronisation in a pack or an unpack, on CUDA: every registered strategy runs a
steady training step under ``torch.cuda.set_sync_debug_mode("error")``, where any call that
waits for the device (``.item()``, ``.tolist()``, a boolean test of a device tensor, a
non-blocking-less copy to the host) raises. A strategy added tomorrow is checked the day it is
registered."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch

import torchstash as ts
from torchstash.testing.models import zoo

#: every strategy, and stock first (a model whose own step waits would fail them all)
STRATEGIES = [None, *ts.REGISTRY.names()]
MODELS = {e.name: e for e in zoo("tiny")}


@contextlib.contextmanager
def sync_errors() -> Iterator[None]:
    """Synchronising calls raise inside, and only inside: the mode is process-wide, so it is
    set back whatever happens (torch warns that the mode is a prototype when it is set; the
    warning is expected, and as an error it had left the mode on for every later test)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Synchronization debug mode is a prototype")
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_steady_step_never_waits_for_the_device(strategy: str | None, model_name: str) -> None:
    entry = MODELS[model_name]
    device = torch.device("cuda")
    x, y = entry.batch(8, device)
    torch.manual_seed(0)
    model = entry.build().to(device)
    handle = ts.apply(model, strategy) if strategy is not None else None
    try:
        for _ in range(3):  # kernels load, running estimates and budgets settle
            model.zero_grad(set_to_none=True)
            entry.loss(model, x, y).backward()
        torch.cuda.synchronize()
        with sync_errors():
            loss = entry.loss(model, x, y)
            loss.backward()
        assert torch.isfinite(loss).item()
    finally:
        if handle is not None:
            handle.remove()
