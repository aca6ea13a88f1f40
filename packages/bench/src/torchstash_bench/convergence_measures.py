"""What a convergence run reads of a model beside its loss curve: the validation loss, what
stock saves for a step, and the strategy's gradient cosines against stock's at the first
step and at stock's trained weights (``scripts/convergence.py``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchstash
from torchstash.policy import parse_spec

from .convergence_tasks import Task

#: A parameter whose stock gradient norm is at most this fraction of the whole gradient's is
#: left out of the worst per-parameter cosine (its gradient is zero up to rounding).
ZERO_GRAD = 1e-4


@torch.no_grad()
def evaluate(task: Task, model: nn.Module) -> tuple[float, float | None]:
    """Mean validation loss (weighted by examples) and, for a classifier, accuracy."""
    model.eval()
    total = correct = 0.0
    count = 0
    for x, y in task.val:
        out = model(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")
        total += loss.item()
        count += y.numel()
        if task.classify:
            correct += (out.argmax(-1) == y).sum().item()
    model.train()
    return total / count, (correct / count if task.classify else None)


def stock_bytes(task: Task, model: nn.Module) -> int:
    """What stock PyTorch saves for one step, counted by ``none`` (the identity) on a copy."""
    twin = copy.deepcopy(model)
    with torchstash.apply(twin, "none") as h:
        x, y = task.batch(0)
        task.loss(twin, x, y).backward()
        return h.tally.raw_bytes


@dataclass
class Cosines:
    """Gradient cosines against stock at step 0."""

    worst: float  # the lowest over the parameters compared
    worst_param: str | None
    whole: float  # of the whole gradient, all parameters as one vector
    skipped: list[str]  # parameters whose stock gradient is zero up to rounding


def grad_cosines(model: nn.Module, stock: dict[str, Tensor]) -> Cosines:
    """Cosines between this model's gradient and stock's, per parameter (a missing gradient
    counts as cosine 0) and of the whole gradient.

    A parameter whose stock gradient is zero up to float rounding (norm at most
    :data:`ZERO_GRAD` of the whole gradient's) is left out: its cosine compares rounding
    noise. Such parameters exist: at initialization the loss does not depend on the scale
    of a BatchNorm followed by ReLU and a bias-free conv into another BatchNorm."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    ref_all = torch.cat([r.double().flatten() for r in stock.values()])
    own_all = torch.cat(
        [
            (grads[n] if grads.get(n) is not None else torch.zeros_like(r)).double().flatten()
            for n, r in stock.items()
        ]
    )
    whole = float(own_all @ ref_all / (own_all.norm() * ref_all.norm()).clamp_min(1e-300))
    floor = ZERO_GRAD * float(ref_all.norm())
    worst, where, skipped = 1.0, None, []
    for name, ref in stock.items():
        ref64 = ref.double().flatten()
        ref_norm = float(ref64.norm())
        if ref_norm <= floor:
            skipped.append(name)
            continue
        g = grads.get(name)
        if g is None:
            cos = 0.0
        else:
            g64 = g.double().flatten()
            denom = ref_norm * float(g64.norm())
            cos = float(g64 @ ref64) / denom if denom > 0 else 0.0
        if where is None or cos < worst:
            worst, where = cos, name
    return Cosines(worst, where, whole, skipped)


@dataclass
class Trained:
    """Stock's weights at the end of its run, and its gradient there on a held-out batch."""

    state: dict[str, Tensor]
    grads: dict[str, Tensor]


def gradients(task: Task, model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    task.loss(model, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


#: Passes a strategy makes over the probe batch before its gradient there is taken: its
#: running estimates and allocations settle as they would have in training (``quant.auto``
#: re-allocates after 20 steps; on its first step it codes everything at the budget's width).
SETTLE_PASSES = 24


def trained_cosines(task: Task, strategy: str, trained: Trained, seed: int) -> Cosines:
    """The strategy's gradient against stock's at stock's trained weights (same batch)."""
    torch.manual_seed(seed)
    model = task.build().to(task.device)
    model.load_state_dict(trained.state)
    spec, options = parse_spec(strategy)
    x, y = task.val[0]
    with torchstash.apply(model, spec, **options):
        for _ in range(SETTLE_PASSES):
            gradients(task, model, x, y)
        gradients(task, model, x, y)
    model.load_state_dict(trained.state)  # BatchNorm's running statistics moved
    return grad_cosines(model, trained.grads)
