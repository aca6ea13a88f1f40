"""torchstash-memsave: a torchstash plug-in (found through the ``torchstash.plugins`` entry point).

Its strategies are being built; see this package's README for what is coming.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:
    from torchstash.registry import Registry

__all__ = ["__version__", "register"]


def register(registry: Registry) -> None:
    """Register this plug-in's strategies under the ``memsave`` prefix (none yet)."""
    del registry
