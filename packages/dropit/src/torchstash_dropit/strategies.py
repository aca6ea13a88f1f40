"""The dropit strategies: their factories, and ``register`` (the plug-in's entry point)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .mink import MinK
from .randomdrop import RandomDrop

if TYPE_CHECKING:
    from torchstash.registry import Registry


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
    return MinK(
        gamma, scope, storage, exact, min_numel, fill=fill, keep=keep, dense=dense, indices=indices
    )


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
    return RandomDrop(p, scope, storage, seed, min_numel, keep=keep, dense=dense, indices=indices)


def register(registry: Registry) -> None:
    """Register ``dropit.mink`` and ``dropit.random``."""
    registry.register(
        "dropit.mink",
        mink,
        lossless=False,
        summary="DropIT: keep the largest (1 - gamma) of linear/conv inputs (bitmap or offsets)",
    )
    registry.register(
        "dropit.random",
        random,
        lossless=False,
        summary="keep a random (1 - p) of linear/conv inputs, rescaled (unbiased)",
    )
