"""What a compiled graph saves, counted at calls with other shapes than the one it was traced at.

A graph traced with dynamic shapes (``mark_dynamic``, or dynamo's automatic dynamic after a
shape changed) serves every shape its guards allow: what it saves is a function of its input
sizes, not a number. The bytes its hooks counted while traced are symbolic (``SymInt``);
turning them into numbers there (``int()``) would specialize the graph to the traced shape and
recompile it for each new one. So the counts keep their expressions (:class:`Bytes`), and each
call evaluates them at its own sizes: each size symbol's value read from the call's arguments
through the source dynamo recorded for it (``L['idx'].size()[1]``), or, where that source is
not among the model's arguments (a graph after a graph break inside the model), at
the traced value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from .engine.tally import Tally
from .engine.totals import COUNTS, Totals

#: how a size symbol is read from a call: keys and indices from the frame's arguments, then
#: the size index (``(("idx",), 1)`` reads ``idx.size(1)``)
Path = tuple[tuple[Any, ...], int]


@dataclass(frozen=True, slots=True)
class Bytes:
    """A byte count of a graph traced with dynamic shapes: its expression in the size symbols,
    how each symbol is read from a call, and each symbol's traced value."""

    expr: Any  # a sympy expression
    paths: tuple[tuple[Any, Path | None], ...]  # (symbol, its path or None)
    traced: Mapping[Any, int]

    @classmethod
    def of(cls, value: Any) -> int | Bytes:
        """``value`` as counted: an int, or a SymInt's expression and its symbols' paths."""
        if not isinstance(value, torch.SymInt):
            return int(value)
        node = value.node
        expr = node.expr
        if expr.is_number:
            return int(expr)
        env = node.shape_env
        paths = tuple(
            (sym, _path(env.var_to_sources.get(sym, ())))
            for sym in sorted(expr.free_symbols, key=str)
        )
        hints = getattr(env, "backed_var_to_val", None)
        if hints is None:  # its name before torch 2.14
            hints = env.var_to_val
        traced = {sym: int(hints[sym]) for sym, _ in paths if sym in hints}
        return cls(expr, paths, traced)

    def at(self, arguments: Mapping[str, Any]) -> int:
        values = {}
        for sym, path in self.paths:
            found = _read(arguments, path) if path is not None else None
            values[sym] = found if found is not None else self.traced.get(sym, 0)
        return int(self.expr.xreplace(values))

    def resolved(self, arguments: Mapping[str, Any]) -> bool:
        """Whether every size symbol is read from ``arguments`` (not taken as traced)."""
        return all(p is not None and _read(arguments, p) is not None for _, p in self.paths)


def _path(sources: Any) -> Path | None:
    """The first of a symbol's sources that reads a size of a frame argument, as a path."""
    from torch._dynamo.source import (
        GetItemSource,
        LocalSource,
        TensorProperty,
        TensorPropertySource,
    )

    for source in sources:
        if not (isinstance(source, TensorPropertySource) and source.prop is TensorProperty.SIZE):
            continue
        keys: list[Any] = []
        base = source.base
        while isinstance(base, GetItemSource) and not base.index_is_slice:
            keys.append(base.index)
            base = base.base
        if isinstance(base, LocalSource) and source.idx is not None:
            return ((base.local_name, *reversed(keys)), int(source.idx))
    return None


def _read(arguments: Mapping[str, Any], path: Path) -> int | None:
    keys, dim = path
    value: Any = arguments
    try:
        for key in keys:
            value = value[key]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(value, torch.Tensor) or dim >= value.dim():
        return None
    return int(value.shape[dim])


def symbolic(totals: list[Totals]) -> bool:
    return any(isinstance(c, Bytes) for t in totals for c in cast(Any, t.counts))


def totals_of(tally: Tally) -> list[Totals]:
    """What ``tally`` (one traced call's counts) adds per row, each symbolic count as
    :class:`Bytes`: read without comparing a SymInt, which would add a guard."""
    return [
        Totals(
            row.module,
            row.module_type,
            cast(tuple[int, ...], tuple(Bytes.of(getattr(row, c)) for c in COUNTS)),
            dict(row.ops),
            dict(row.declined),
        )
        for row in tally.rows.values()
    ]


def resolved(totals: list[Totals], arguments: Mapping[str, Any]) -> bool:
    """Whether :func:`at` reads every size of ``totals`` from ``arguments``."""
    counts = (c for t in totals for c in cast(Any, t.counts))
    return all(c.resolved(arguments) for c in counts if isinstance(c, Bytes))


def at(totals: list[Totals], arguments: Mapping[str, Any]) -> list[Totals]:
    """``totals`` counted at a call whose frame arguments are ``arguments``."""
    return [
        Totals(
            t.module,
            t.module_type,
            tuple(c.at(arguments) if isinstance(c, Bytes) else c for c in cast(Any, t.counts)),
            t.ops,
            t.declined,
        )
        for t in totals
    ]


__all__ = ["Bytes", "at", "resolved", "symbolic", "totals_of"]
