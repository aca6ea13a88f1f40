"""torchstash: train in less memory by shrinking what autograd saves for backward.

import torchstash as ts
handle = ts.apply(model, "quant.int8")   # in place; handle.remove() undoes it
with ts.stash("quant.int8"):             # any code region
    loss = step(batch)
print(ts.measure(model, step))           # per-module saved bytes, before and after
"""

from __future__ import annotations

from . import errors
from ._version import __version__
from .api import Handle, apply, handle_of, remove, stash, strategies
from .compressor import BaseCompressor, Composed, Compressor
from .measure import ModuleRow, Report, measure
from .opmark import as_op, engine_active, untracked
from .packed import Packed
from .plan import Rewriter, Swapped
from .policy import Policy, Rule
from .registry import AS_IS, REGISTRY, Registry, Strategy, register_strategy
from .site import OpCall, Site

__all__ = [
    "AS_IS",
    "REGISTRY",
    "BaseCompressor",
    "Composed",
    "Compressor",
    "Handle",
    "ModuleRow",
    "OpCall",
    "Packed",
    "Policy",
    "Registry",
    "Report",
    "Rewriter",
    "Swapped",
    "Rule",
    "Site",
    "Strategy",
    "__version__",
    "apply",
    "as_op",
    "engine_active",
    "errors",
    "handle_of",
    "measure",
    "register_strategy",
    "remove",
    "stash",
    "strategies",
    "untracked",
]
