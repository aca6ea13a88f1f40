"""The dropit strategies: their factories, and ``register`` (the plug-in's entry point)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchstash.declare import StrategyTable

from .mink import MinK
from .randomdrop import RandomDrop

if TYPE_CHECKING:
    from torchstash.registry import Registry

STRATEGIES = StrategyTable()


@STRATEGIES.strategy("dropit.mink", lossless=False)
def mink(
    gamma: float = 0.9,
    scope: str = "feature",
    storage: str = "auto",
    exact: bool = True,
    min_numel: int = 4096,
    fill: str = "zero",
    keep: str = "ceil",
    dense: str = "exact",
    indices: str = "device",
) -> MinK:
    """DropIT: keep the largest (1 - gamma) of linear/conv inputs (bitmap or offsets)."""
    return MinK(
        gamma, scope, storage, exact, min_numel, fill=fill, keep=keep, dense=dense, indices=indices
    )


@STRATEGIES.strategy("dropit.random", lossless=False)
def random(
    p: float = 0.9,
    scope: str = "tensor",
    storage: str = "auto",
    seed: int | None = None,
    min_numel: int = 4096,
    keep: str = "ceil",
    dense: str = "exact",
    indices: str = "device",
) -> RandomDrop:
    """Keep a random (1 - p) of linear/conv inputs, rescaled (unbiased)."""
    return RandomDrop(p, scope, storage, seed, min_numel, keep=keep, dense=dense, indices=indices)


def register(registry: Registry) -> None:
    """Register ``dropit.mink`` and ``dropit.random``."""
    STRATEGIES.register(registry)
