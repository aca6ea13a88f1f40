"""The engine: saved-tensor hooks that compress what autograd saves, with exact accounting.

Its pieces, one idea each: :mod:`.core` (the pack and unpack hooks, choosing and storing),
:mod:`.scope` (which module and op call is running; the :class:`~torchstash.site.Site`),
:mod:`.params` (parameters and their copies stay as they are), :mod:`.entries` (what is kept
for one saved tensor), :mod:`.recompute` (outputs rebuilt from a stored input, with
:mod:`torchstash.derive`'s recipes), :mod:`.tally` (the accounting) and :mod:`.messages`
(every text it says). Plug-ins never import it: what they need comes in the ``Site``.
"""

from __future__ import annotations

from .core import DEFAULT_MIN_BYTES, Engine, Resolver
from .messages import CONSTANT_REASON, FUSED_EXACT_REASON, FUSED_OUTPUT_REASON, KEEP_TYPE
from .scope import ModuleInfo
from .tally import Row, Tally

__all__ = [
    "CONSTANT_REASON",
    "DEFAULT_MIN_BYTES",
    "FUSED_EXACT_REASON",
    "FUSED_OUTPUT_REASON",
    "KEEP_TYPE",
    "Engine",
    "ModuleInfo",
    "Resolver",
    "Row",
    "Tally",
]
