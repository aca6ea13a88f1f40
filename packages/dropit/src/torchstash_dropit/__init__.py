"""torchstash-dropit: DropIT's dropping of small linear-type inputs, stored so it saves memory.

Strategies (found through the ``torchstash.plugins`` entry point):

* ``dropit.mink`` (``gamma=0.9``): the largest-magnitude ``1 - gamma`` of each input a
  linear, conv or ``addmm`` saves for its weight gradient, as a bitmap or 16-bit offsets plus
  the values, whichever is smaller;
* ``dropit.random`` (``p=0.9``): a uniformly random ``1 - p`` share, rescaled (unbiased).

``to_dropit(model, strategy='mink', gamma=0.9)`` is the drop-in for DropIT users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__
from .convert import to_dropit
from .mink import MinK
from .randomdrop import RandomDrop

if TYPE_CHECKING:
    from torchstash.registry import Registry

__all__ = ["MinK", "RandomDrop", "__version__", "register", "to_dropit"]


def mink(
    gamma: float = 0.9,
    scope: str = "feature",
    storage: str = "auto",
    exact: bool = True,
    min_numel: int = 4096,
    fill: str = "zero",
) -> MinK:
    return MinK(gamma, scope, storage, exact, min_numel, fill=fill)


def random(
    p: float = 0.9,
    scope: str = "tensor",
    storage: str = "auto",
    seed: int | None = None,
    min_numel: int = 4096,
) -> RandomDrop:
    return RandomDrop(p, scope, storage, seed, min_numel)


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
