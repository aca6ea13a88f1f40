"""Outputs recomputed from a stored input: a GELU's output is its input, one op later.

A transformer saves most activations twice over: a LayerNorm keeps its input and the next
projection keeps the LayerNorm's output; a GELU keeps its input and the next Linear keeps the
GELU's output. Both outputs are a cheap function of the input already stored. When the
strategy stores that input compressed anyway and says its code is fine to recompute from
(``derivable(x, site)`` on the compressor), the engine keeps a later save of the output as a
:class:`Recipe` over the input's entry: no bytes of its own, the op applied again to the
restored input in backward. The bytes saved can buy the input a wider code, so the output
comes back closer to exact than its own code of the same total size would give.

Only for ops whose output is a pure function of the input, arguments and the statistics the
op saved (:data:`DERIVE_OPS`); anything else saved is stored as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: Ops whose output the engine can recompute from their saved input.
DERIVE_OPS = frozenset({"gelu", "silu", "layer_norm"})


def _argument(args: Sequence[Any], kwargs: dict[str, Any], name: str, pos: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


@dataclass
class Recipe:
    """How to recompute one call's output: the op, its non-input arguments, the statistics it
    saved (a LayerNorm's mean and reciprocal std, in save order) and the output's dtype."""

    op: str
    arguments: dict[str, Any]
    stats: list[torch.Tensor] = field(default_factory=list)
    dtype: torch.dtype | None = None
    #: False when a statistic was stored as a code: the output is then stored as usual
    usable: bool = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _RECOMPUTE[self.op](self, x)
        return out if self.dtype is None else out.to(self.dtype)


def recipe(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> Recipe | None:
    """The recipe for the running call of ``op``, or None when its output cannot be rebuilt
    from the input alone (an in-place SiLU, a LayerNorm without its statistics)."""
    if op == "gelu":
        approximate = _argument(args, kwargs, "approximate", 1) or "none"
        return Recipe(op, {"approximate": str(approximate)})
    if op == "silu":
        if _argument(args, kwargs, "inplace", 1):
            return None
        return Recipe(op, {})
    if op == "layer_norm":
        weight = _argument(args, kwargs, "weight", 2)
        bias = _argument(args, kwargs, "bias", 3)
        return Recipe(op, {"weight": weight, "bias": bias})
    return None


def _gelu(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate=r.arguments["approximate"])


def _silu(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _layer_norm(r: Recipe, x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) * rstd * weight + bias`` with the exact statistics the forward saved, so
    the output agrees with what the LayerNorm's own backward sees of the same input."""
    if len(r.stats) != 2:
        raise RuntimeError(
            f"layer_norm recipe: expected the mean and rstd the op saved, got {len(r.stats)} "
            "tensors"
        )
    mean, rstd = r.stats
    y = (x.to(rstd.dtype) - mean) * rstd
    weight, bias = r.arguments["weight"], r.arguments["bias"]
    if weight is not None:
        y = y * weight.detach()
    if bias is not None:
        y = y + bias.detach()
    return y


_RECOMPUTE: dict[str, Callable[[Recipe, torch.Tensor], torch.Tensor]] = {
    "gelu": _gelu,
    "silu": _silu,
    "layer_norm": _layer_norm,
}
