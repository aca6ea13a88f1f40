"""torchstash-dropit: DropIT's dropping of small linear-type inputs, stored so it saves memory.

Strategies (found through the ``torchstash.plugins`` entry point):

* ``dropit.mink`` (``gamma=0.9``): the largest-magnitude ``1 - gamma`` of each input a
  linear, conv or ``addmm`` saves for its weight gradient, as a bitmap or 16-bit offsets plus
  the values, whichever is smaller;
* ``dropit.random`` (``p=0.9``): a uniformly random ``1 - p`` share, rescaled (unbiased).

``to_dropit(model, strategy='mink', gamma=0.9)`` is the drop-in for DropIT users.
"""

from __future__ import annotations

from ._options import FILLS, SCOPES, STORAGES
from ._version import __version__
from .compat import to_dropit
from .mink import MinK
from .randomdrop import RandomDrop
from .strategies import register

__all__ = [
    "FILLS",
    "SCOPES",
    "STORAGES",
    "MinK",
    "RandomDrop",
    "__version__",
    "register",
    "to_dropit",
]
