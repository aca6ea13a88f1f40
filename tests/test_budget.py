"""apply(model, budget_mb=...): per-module strategies measured on the user's step, fitting the
budget with the least gradient error, reported; infeasible budgets and bad input are clear."""

from __future__ import annotations

import pytest
import torch

import torchstash as ts
from torchstash.budget import MB
from torchstash.errors import ApplyError
from torchstash.testing.models import zoo

MODELS = {e.name: e for e in zoo("tiny")}


def _setup(name: str) -> tuple[torch.nn.Module, object, int]:
    entry = MODELS[name]
    torch.manual_seed(0)
    model = entry.build()
    x, y = entry.batch(8, torch.device("cpu"))
    step = lambda m: entry.loss(m, x, y)  # type: ignore[attr-defined]
    with ts.apply(model, "none") as h:
        step(model).backward()
        stock = h.tally.stored_bytes
    model.zero_grad()
    return model, step, stock


@pytest.mark.parametrize(("name", "fraction"), [("gpt", 0.25), ("resnet", 0.4)])
def test_fits_and_trains(name: str, fraction: float) -> None:
    model, step, stock = _setup(name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    handle = ts.apply(model, budget_mb=stock * fraction / MB, example=step)
    plan = handle.budget
    assert plan is not None and plan.fits
    assert plan.measured_bytes <= stock * fraction
    assert plan.measured_cosine > 0.98
    # Choosing touched nothing: weights and buffers as they were, no gradients left behind.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    # What it applied saves what it measured.
    handle.tally.reset()
    step(model).backward()  # type: ignore[operator]
    assert handle.tally.stored_bytes == plan.measured_bytes
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert "torchstash budget" in str(plan)
    handle.remove()


def test_a_looser_budget_is_never_less_accurate() -> None:
    model, step, stock = _setup("gpt")
    cos = []
    for fraction in (0.12, 0.5):
        with ts.apply(model, budget_mb=stock * fraction / MB, example=step) as h:
            assert h.budget is not None
            cos.append(h.budget.measured_cosine)
    assert cos[0] <= cos[1]


def test_budget_below_what_candidates_reach_is_a_clear_error() -> None:
    model, step, stock = _setup("resnet")
    with pytest.raises(ApplyError, match=r"budget_mb=.*the least any plan .* measured"):
        ts.apply(model, budget_mb=stock * 0.02 / MB, example=step, candidates=["quant.int8"])
    assert ts.handle_of(model) is None


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"budget_mb": 1.0}, "needs example="),
        ({"budget_mb": -1.0, "example": lambda m: m}, "positive number"),
        (
            {"budget_mb": 1.0, "example": lambda m: m, "candidates": ["quant.int3"]},
            "not an installed",
        ),
        (
            {"budget_mb": 1.0, "example": lambda m: m, "strategy": "quant.int8"},
            "without a strategy",
        ),
        ({"example": lambda m: m}, "go with budget_mb"),
    ],
)
def test_bad_input(kwargs: dict[str, object], message: str) -> None:
    model = MODELS["gpt"].build()
    with pytest.raises(ApplyError, match=message):
        ts.apply(model, **kwargs)  # type: ignore[arg-type]


def test_example_must_return_a_scalar_loss() -> None:
    model = MODELS["gpt"].build()
    x, _ = MODELS["gpt"].batch(2, torch.device("cpu"))
    with pytest.raises(ApplyError, match="scalar loss"):
        ts.apply(model, budget_mb=1.0, example=lambda m: m(x))
