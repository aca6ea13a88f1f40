"""Per-module accounting of what autograd saved: stock's bytes, the bytes kept, and why."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..packed import Packed, StorageLedger, allocation
from ..site import Site


@dataclass
class Row:
    """Accounting for one module (or the top level)."""

    module: str
    module_type: str
    saved: int = 0  # tensors autograd saved here (dedupe hits included)
    shared: int = 0  # of which were already stored (same tensor saved by another op)
    raw_bytes: int = 0  # bytes as stock PyTorch would hold them (each storage once)
    stored_bytes: int = 0  # bytes actually held (the storages of what is kept, each once)
    #: what the allocators hold for stored_bytes: each block at its allocator's granularity,
    #: and on the CPU each storage's and tensor's own record (:class:`~torchstash.packed.Allocation`)
    held_bytes: int = 0
    host_bytes: int = 0  # of stored_bytes, held in host memory for an accelerator tensor
    compressed: int = 0  # tensors a compressor packed
    derived: int = 0  # tensors kept as a recompute from another op's stored input (no bytes)
    declined: Counter[str] = field(default_factory=Counter)  # reason -> count
    ops: Counter[str] = field(default_factory=Counter)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


class Counted(Protocol):
    """What a whole recorded forward adds to one row (:class:`~.totals.Totals`)."""

    @property
    def module(self) -> str: ...

    @property
    def module_type(self) -> str: ...

    @property
    def counts(
        self,
    ) -> tuple[int, ...]:  # saved, shared, raw, stored, held, host, compressed, derived
        ...

    @property
    def ops(self) -> Mapping[str, int]: ...

    @property
    def declined(self) -> Mapping[str, int]: ...


class Tally:
    """Per-module accounting, plus the parameters autograd referenced (never counted as raw)."""

    def __init__(self) -> None:
        self._rows: dict[str, Row] = {}
        #: whole forwards' totals not yet in the rows, by identity: (totals, how many
        #: forwards); a replayed forward costs one update here, the rows catch up when read
        self._pending: dict[int, tuple[Sequence[Counted], int]] = {}
        self.param_refs = 0
        #: bumped by :meth:`reset`: a replayed forward's rows are looked up again
        self.generation = 0
        self._lock = threading.Lock()
        #: the storages counted in raw_bytes and in stored_bytes, each once while held
        self.raw_storages = StorageLedger()
        self.stored_storages = StorageLedger()

    @property
    def rows(self) -> dict[str, Row]:
        """Each module's row, every forward counted."""
        if self._pending:
            self._settle()
        return self._rows

    def add_forward(self, totals: Sequence[Counted]) -> None:
        """Count a whole forward that added ``totals`` (a replayed one): when the rows are
        next read, as if each save had been counted."""
        key = id(totals)  # the sequence is held while pending: its id stays its own
        entry = self._pending.get(key)
        self._pending[key] = (totals, 1 if entry is None else entry[1] + 1)

    def _settle(self) -> None:
        pending, self._pending = self._pending, {}
        rows = self._rows
        for totals, times in pending.values():
            for t in totals:
                row = rows.get(t.module)
                if row is None:
                    row = rows[t.module] = Row(t.module, t.module_type)
                saved, shared, raw, stored, held, host, compressed, derived = t.counts
                row.saved += saved * times
                row.shared += shared * times
                row.raw_bytes += raw * times
                row.stored_bytes += stored * times
                row.held_bytes += held * times
                row.host_bytes += host * times
                row.compressed += compressed * times
                row.derived += derived * times
                for op, n in t.ops.items():
                    row.ops[op] += n * times
                for reason, n in t.declined.items():
                    row.declined[reason] += n * times

    def row(self, site: Site) -> Row:
        r = self.rows.get(site.module)
        if r is None:
            r = self.rows[site.module] = Row(site.module, site.module_type)
        return r

    def keep(self, row: Row, value: torch.Tensor | Packed, owner: object) -> None:
        """Count what ``owner`` keeps in ``value`` in ``row``: the storages no live owner
        counted yet in its stored bytes, and what their allocators hold for them and for each
        tensor in its held bytes."""
        hold = self.stored_storages.hold
        for t in (value,) if isinstance(value, torch.Tensor) else value.payload_tensors():
            nbytes, held = hold(t, owner)
            row.stored_bytes += nbytes
            row.held_bytes += held

    def drop(self, row: Row, value: torch.Tensor | Packed, owner: object) -> None:
        """Undo :meth:`keep`: ``owner`` gave ``value`` up (for its tensor, or for a recipe)."""
        unhold = self.stored_storages.unhold
        for t in (value,) if isinstance(value, torch.Tensor) else value.payload_tensors():
            nbytes, held = unhold(t, owner)
            row.stored_bytes -= nbytes
            row.held_bytes -= held

    def keep_alias(self, row: Row, alias: torch.Tensor) -> None:
        """An entry's version alias (:func:`~.entries.version_alias`): no bytes of the saved
        tensor's, but a tensor's record and its empty storage's."""
        rule = allocation(alias.device)
        row.held_bytes += rule.tensor + rule.storage

    def reset(self) -> None:
        with self._lock:
            self._pending.clear()
            self._rows.clear()
            self.param_refs = 0
            self.generation += 1

    def __repr__(self) -> str:
        """One line a person can read: the totals, the ratio, and why tensors were kept."""
        rows = list(self.rows.values())
        raw, stored = self.raw_bytes, self.stored_bytes
        ratio = f"{raw / stored:.2f}x" if stored else "-"
        compressed = sum(r.compressed for r in rows)
        derived = sum(r.derived for r in rows)
        declined: Counter[str] = Counter()
        for r in rows:
            declined.update(r.declined)
        top = "; ".join(f"{n} x {why}" for why, n in declined.most_common(2))
        return (
            f"<Tally: {raw / 2**20:.3f} MB saved by stock, {stored / 2**20:.3f} MB stored "
            f"({ratio}) in {len(rows)} module(s); {compressed} compressed, {derived} recomputed, "
            f"{sum(declined.values())} kept as they are{': ' + top if top else ''}>"
        )

    @property
    def raw_bytes(self) -> int:
        return sum(r.raw_bytes for r in self.rows.values())

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored_bytes for r in self.rows.values())

    @property
    def held_bytes(self) -> int:
        return sum(r.held_bytes for r in self.rows.values())
