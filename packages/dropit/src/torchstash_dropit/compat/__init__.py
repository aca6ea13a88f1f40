"""Drop-in for DropIT's users: ``import torchstash_dropit.compat as dropit``, then
``dropit.to_dropit(model, strategy, gamma)`` and ``dropit.dropiter.DropITer`` as before."""

from __future__ import annotations

from . import dropiter
from .convert import STRATEGIES, dropit_rules, to_dropit
from .dropiter import DropITer

__all__ = ["STRATEGIES", "DropITer", "dropit_rules", "dropiter", "to_dropit"]
