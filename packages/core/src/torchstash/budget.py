"""A memory budget: per-module strategies that fit it with the least gradient error.

``torchstash.apply(model, budget_mb=..., example=...)`` measures, on the user's own example
step, what each module saves (exact bytes, from the engine's accounting) under every
candidate strategy, and how far the parameter gradients move when only that module's saved
tensors use it. A greedy multiple-choice knapsack then trades error for bytes until the
total fits: each move is the one that saves the most bytes per unit of added error. The
chosen policy is applied, re-measured as a whole and reported (:class:`BudgetPlan`).

The per-module errors are added as if independent; the report gives the measured whole so the
difference shows. The budget counts the bytes autograd keeps for backward on the example
batch (what torchstash controls), not weights, optimizer state or workspace.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from torch import nn

from .errors import ApplyError
from .registry import Registry, resolved

MB = 1024 * 1024
_ATTEMPTS = 6  # whole-model re-measurements while the shared tensors are accounted

Example: TypeAlias = Callable[[nn.Module], torch.Tensor] | tuple[Any, ...] | torch.Tensor
#: :func:`torchstash.apply`'s shape: ``apply(model, policy=rules, min_bytes=n)`` -> a handle
Apply: TypeAlias = Callable[..., Any]


@dataclass(frozen=True)
class Choice:
    """One module's measured options and the one chosen."""

    module: str
    raw_bytes: int
    strategy: str
    stored_bytes: int
    error: float
    options: dict[str, tuple[int, float]] = field(default_factory=dict)  # name: (bytes, error)


@dataclass
class BudgetPlan:
    """What :func:`plan_budget` chose, with its estimate and the whole measured again."""

    budget_bytes: int
    stock_bytes: int
    choices: list[Choice]
    rules: list[dict[str, Any]]
    estimated_bytes: int
    estimated_error: float
    measured_bytes: int = -1
    measured_cosine: float = math.nan

    @property
    def fits(self) -> bool:
        return 0 <= self.measured_bytes <= self.budget_bytes

    def table(self) -> Any:
        from rich.table import Table

        t = Table(
            title=(
                f"torchstash budget {self.budget_bytes / MB:.2f} MB: stock saves "
                f"{self.stock_bytes / MB:.2f} MB, this plan {self.measured_bytes / MB:.2f} MB "
                f"(estimate {self.estimated_bytes / MB:.2f}), gradient cosine "
                f"{self.measured_cosine:.4f}"
            )
        )
        for col in ("module", "stock MB", "strategy", "MB", "error (1 - cos)"):
            t.add_column(col, justify="left" if col in ("module", "strategy") else "right")
        for c in self.choices:
            t.add_row(
                c.module or "<root>",
                f"{c.raw_bytes / MB:.3f}",
                c.strategy,
                f"{c.stored_bytes / MB:.3f}",
                f"{c.error:.2e}",
            )
        return t

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=110, record=True, file=None)
        with console.capture() as cap:
            console.print(self.table())
        return cap.get()


def _as_step(example: Example) -> Callable[[nn.Module], torch.Tensor]:
    if callable(example) and not isinstance(example, torch.Tensor):
        return example
    args = example if isinstance(example, tuple) else (example,)

    def step(model: nn.Module) -> torch.Tensor:
        out = model(*args)
        out = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(out, torch.Tensor):
            raise ApplyError(
                "budget_mb: the model's output is not a tensor; pass example= a function "
                "that runs the model and returns the loss"
            )
        return out.float().square().mean()  # a stand-in loss: pass a loss function if you can

    return step


def _grads(
    model: nn.Module, step: Callable[[nn.Module], torch.Tensor], seed: int
) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    devices = sorted(
        {p.device.index for p in params if p.device.type == "cuda" and p.device.index is not None}
    )
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        loss = step(model)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ApplyError(
                f"budget_mb: example must return a scalar loss tensor, got "
                f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        got = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, got)]


def _one_minus_cos(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))
    na = math.sqrt(sum(float(x.double().square().sum()) for x in a))
    nb = math.sqrt(sum(float(y.double().square().sum()) for y in b))
    if na == 0.0 or nb == 0.0:
        return 0.0 if na == nb else 1.0
    return max(0.0, 1.0 - dot / (na * nb))


def _measure(
    model: nn.Module,
    step: Callable[[nn.Module], torch.Tensor],
    rules: list[dict[str, Any]],
    seed: int,
    min_bytes: int,
    apply: Apply,
) -> tuple[list[torch.Tensor], dict[str, tuple[int, int]]]:
    """Gradients and per-module (raw, stored) bytes of one step under ``rules``."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handle = apply(model, policy=rules, min_bytes=min_bytes)
    try:
        grads = _grads(model, step, seed)
        rows = {n: (r.raw_bytes, r.stored_bytes) for n, r in handle.tally.rows.items()}
    finally:
        handle.remove()
        with torch.no_grad():  # a measuring step must not move BatchNorm's statistics
            for b, saved in buffers:
                b.copy_(saved)
    return grads, rows


def _candidates(requested: Sequence[str] | None, registry: Registry) -> list[str]:
    if requested is None:
        names = [s.name for s in registry.candidates()]
        if not names:
            raise ApplyError(
                "budget_mb: no installed plug-in offers a budget candidate (a strategy "
                "registered with candidate=True); install torchstash-quant or "
                "torchstash-memsave, or pass candidates=[...]"
            )
        return names
    out = []
    for name in requested:
        if name not in registry.names():
            raise ApplyError(
                f"budget_mb: candidate {name!r} is not an installed strategy; "
                f"installed: {', '.join(registry.names())}"
            )
        out.append(name)
    return out


def _greedy(
    units: list[str], table: dict[str, dict[str, tuple[int, float]]], budget: int
) -> dict[str, str]:
    """Start every module on its least-error option; take the best bytes-per-error move until it fits."""
    pick = {u: min(table[u], key=lambda s: (table[u][s][1], table[u][s][0])) for u in units}
    total = sum(table[u][pick[u]][0] for u in units)
    while total > budget:
        best: tuple[float, str, str] | None = None
        for u in units:
            cur_b, cur_e = table[u][pick[u]]
            for s, (b, e) in table[u].items():
                if b >= cur_b:
                    continue
                gain = (cur_b - b) / max(e - cur_e, 1e-12)
                if best is None or gain > best[0]:
                    best = (gain, u, s)
        if best is None:
            break
        _, u, s = best
        total += table[u][s][0] - table[u][pick[u]][0]
        pick[u] = s
    return pick


def _plan(
    rules: list[dict[str, Any]],
    choices: list[Choice],
    budget: int,
    stock_total: int,
    rows: dict[str, tuple[int, int]],
    exact: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
) -> BudgetPlan:
    return BudgetPlan(
        budget_bytes=budget,
        stock_bytes=stock_total,
        choices=choices,
        rules=rules,
        estimated_bytes=sum(c.stored_bytes for c in choices) if choices else -1,
        estimated_error=sum(c.error for c in choices) if choices else math.nan,
        measured_bytes=sum(stored for _, stored in rows.values()),
        measured_cosine=1.0 - _one_minus_cos(exact, grads),
    )


def plan_budget(
    model: nn.Module,
    budget_mb: float,
    example: Example,
    *,
    apply: Apply,
    candidates: Sequence[str] | None = None,
    seed: int = 0,
    min_bytes: int | None = None,
    registry: Registry | None = None,
) -> BudgetPlan:
    """Measure and choose; the model is left as it was (see the module docstring).
    ``apply`` is :func:`torchstash.apply`, which calls this (passed in: no import loop);
    ``registry`` holds the candidates (default: the process's)."""
    from .engine import DEFAULT_MIN_BYTES

    if not isinstance(budget_mb, (int, float)) or not budget_mb > 0:
        raise ApplyError(f"budget_mb must be a positive number of megabytes, got {budget_mb!r}")
    if example is None:
        raise ApplyError(
            "budget_mb needs example=: a function that runs one training step's forward on a "
            "representative batch and returns the loss (or the model's input tensors)"
        )
    min_bytes = DEFAULT_MIN_BYTES if min_bytes is None else min_bytes
    registry = resolved(registry)
    apply = functools.partial(apply, registry=registry)
    names = _candidates(candidates, registry)
    step = _as_step(example)
    budget = int(budget_mb * MB)

    exact, stock_rows = _measure(model, step, [{"strategy": "none"}], seed, min_bytes, apply)
    units = sorted(u for u, (raw, _) in stock_rows.items() if raw > 0)
    table: dict[str, dict[str, tuple[int, float]]] = {
        u: {"none": (stock_rows[u][1], 0.0)} for u in units
    }
    stock_total = sum(stored for _, stored in stock_rows.values())
    uniform: list[BudgetPlan] = []
    for name in names:
        whole_grads, rows = _measure(model, step, [{"strategy": name}], seed, min_bytes, apply)
        uniform.append(
            _plan([{"strategy": name}], [], budget, stock_total, rows, exact, whole_grads)
        )
        for u in units:
            if rows.get(u, stock_rows[u])[1] >= stock_rows[u][1]:
                continue  # saves nothing here even with every module on it
            # Alone: a tensor two modules save is stored once, so one module's saving can
            # depend on its neighbour's; measuring it alone keeps the sum honest.
            rules = [{"strategy": "none"}, {"module": u, "strategy": name}]
            grads, alone = _measure(model, step, rules, seed, min_bytes, apply)
            delta = sum(b for _, b in alone.values()) - stock_total
            if delta >= 0:
                continue
            error = 0.0 if registry.get(name).lossless else _one_minus_cos(exact, grads)
            table[u][name] = (stock_rows[u][1] + delta, error)

    tried: list[BudgetPlan] = list(uniform)
    target = budget
    for _ in range(_ATTEMPTS):
        pick = _greedy(units, table, target)
        rules = [{"strategy": "none"}]
        rules += [{"module": u, "strategy": s} for u, s in pick.items() if s != "none"]
        choices = [
            Choice(u, stock_rows[u][0], pick[u], *table[u][pick[u]], table[u]) for u in units
        ]
        grads, rows = _measure(model, step, rules, seed, min_bytes, apply)
        plan = _plan(rules, choices, budget, stock_total, rows, exact, grads)
        tried.append(plan)
        if plan.fits or plan.estimated_bytes > target:
            break  # fits, or per-module choices cannot go lower
        # Neighbours sharing a tensor can save more together than alone, or less: aim lower.
        target = int(target * budget / max(plan.measured_bytes, 1) * 0.98)
    fitting = [p for p in tried if p.fits]
    if not fitting:
        closest = min(tried, key=lambda p: p.measured_bytes)
        raise ApplyError(
            f"budget_mb={budget_mb}: the least any plan of {', '.join(names)} measured on this "
            f"example is {closest.measured_bytes / MB:.2f} MB (stock: {stock_total / MB:.2f} "
            "MB); raise the budget, add narrower candidates (quant.int1, dropit.mink) or use a "
            "smaller batch"
        )
    # The most accurate plan that fits: per-module choices, or one strategy everywhere.
    plan = max(fitting, key=lambda p: p.measured_cosine)
    return plan
