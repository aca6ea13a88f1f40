"""What several of the core's test files share: the kernels' parity constants, a spy on the
reference functions, a one-layer model with a written-out forward, and a step measured against
stock PyTorch. Imported relatively (``from ._helpers import ...``): pytest's importlib mode
imports the test files as modules of this folder."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.kernels import Impl
from torchstash.testing.models import ZooEntry

# -- compiled kernels -------------------------------------------------------------------------

#: the float dtypes every kernel reads and writes
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS: tuple[Impl, ...] = ("kernel", "ref")
INF, NAN = float("inf"), float("nan")


def assert_bad_impl_refused(op: Callable[..., Any], *args: Any) -> None:
    """``op(*args, impl="fast")`` is refused by name, before any work."""
    bad: Any = "fast"
    with pytest.raises(ValueError, match="impl='fast' is not valid"):
        op(*args, impl=bad)


def spy_on(monkeypatch: pytest.MonkeyPatch, module: ModuleType, names: Iterable[str]) -> list[str]:
    """Wraps ``module``'s functions ``names`` (for the test) to note each call by name; returns
    the notes, in call order. A kernel's dispatch that takes the compiled op calls none."""
    calls: list[str] = []
    for name in names:
        real = getattr(module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(module, name, spy)
    return calls


# -- models and steps -------------------------------------------------------------------------


class LinearThen(nn.Module):
    """A square Linear layer, then ``then`` on its output, written out in this module's own
    forward (not a submodule's): the ops a test is about, with a parameter before them."""

    def __init__(self, features: int, then: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.then = then

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.fc(x))


def stock_then_measured(
    entry: ZooEntry,
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    strategy: str,
    **options: Any,
) -> tuple[list[torch.Tensor], ts.Report]:
    """A stock backward's gradients (cloned), then one step measured under ``strategy`` (no
    warm-up), whose gradients stay on ``model`` to compare with them."""
    x, y = batch
    entry.loss(model, x, y).backward()
    stock = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    report = ts.measure(
        model,
        lambda: (model.zero_grad(), entry.loss(model, x, y).backward()),
        strategy,
        repeat=1,
        warmup=0,
        **options,
    )
    return stock, report
