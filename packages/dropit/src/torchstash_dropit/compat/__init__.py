"""Drop-in for DropIT's users: ``to_dropit(model, strategy, gamma)`` and ``no_dropit_rules``."""

from __future__ import annotations

from .convert import STRATEGIES, no_dropit_rules, to_dropit

__all__ = ["STRATEGIES", "no_dropit_rules", "to_dropit"]
