"""What a whole recorded forward adds to each row of the tally: a replayed forward counts
its recording's totals instead of counting each save (:meth:`~.tally.Tally.add_forward`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tally import Tally


#: the counts of a row a forward adds to (``ops`` and ``declined`` apart)
COUNTS = (
    "saved",
    "shared",
    "raw_bytes",
    "stored_bytes",
    "held_bytes",
    "host_bytes",
    "compressed",
    "derived",
)


def snapshot(tally: Tally) -> dict[str, tuple[Any, ...]]:
    return {
        name: (*(getattr(row, c) for c in COUNTS), dict(row.ops), dict(row.declined))
        for name, row in tally.rows.items()
    }


@dataclass(slots=True, eq=False)
class Totals:
    """What a whole forward adds to one row."""

    module: str
    module_type: str
    counts: tuple[int, ...]  # in the order of :data:`COUNTS`
    ops: dict[str, int]
    declined: dict[str, int]

    def signature(self) -> tuple[Any, ...]:
        return (self.module, self.counts, sorted(self.ops.items()), sorted(self.declined.items()))


def diff(before: dict[str, tuple[Any, ...]], tally: Tally) -> list[Totals]:
    out = []
    empty = (*(0 for _ in COUNTS), {}, {})
    for name, row in tally.rows.items():
        old = before.get(name, empty)
        counts = tuple(getattr(row, c) - o for c, o in zip(COUNTS, old, strict=False))
        ops = {k: n - old[-2].get(k, 0) for k, n in row.ops.items() if n != old[-2].get(k, 0)}
        declined = {
            k: n - old[-1].get(k, 0) for k, n in row.declined.items() if n != old[-1].get(k, 0)
        }
        if any(counts) or ops or declined:
            out.append(Totals(name, row.module_type, counts, ops, declined))
    return out


__all__ = ["COUNTS", "Totals", "diff", "snapshot"]
