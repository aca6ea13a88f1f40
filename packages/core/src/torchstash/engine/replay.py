"""Decide once, then replay: the engine's per-save decisions, recorded on a step and followed
on the next ones behind cheap guards.

What a save gets depends on things that repeat from step to step: the module and its call,
the op, the tensor's shape, dtype and device, and which earlier save of the step shares its
storage. The engine's full path (op tracker, policy, dedupe table, storage ledgers) decides on
a recording step; :class:`Recorder` notes each decision as a :class:`Move`. Two recordings in
a row that agree make a :class:`Trace`; while one is held, a forward runs without the op
tracker and each save is one guarded lookup (:meth:`Replayer.pack`). A guard miss (another
shape, a module not run before, a new storage sharing) keeps that save and the rest of the
forward exactly as stock PyTorch keeps them, and the next forward records again.

Only decisions that keep tensors as they are replay today: a parameter, a tensor stored as is
(with the reason, ``min_bytes`` say), and a second save of one of those. A forward that
compressed or recomputed anything records on every step (its codes read the op's arguments).
The bytes a replayed step counts are the recording's, for the same saves over the same
storage sharing within the step (exact in a training loop; a storage held across steps by a
live graph is counted as the recording counted it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..packed import storage_base
from ..site import Site
from .entries import Entry, Saved, dedupe_key
from .params import parameter_copy
from .tally import Row

if TYPE_CHECKING:
    from .scope import ThreadState
    from .tally import Tally

#: what a move does with its save
PARAM, KEEP, SHARED = "param", "keep", "shared"

#: guard misses in a row after which an engine stops replaying
MAX_MISSES = 3

#: why the saves after a guard miss are kept as they are (a row's ``declined`` reason)
MISSED_REASON = "recorded again after a change (a guard missed)"


@dataclass(slots=True, eq=False)
class Move:
    """One save of a recorded forward: what the engine did, and what a replayed save must
    match to do the same."""

    kind: str
    owner: weakref.ref[Any] | None  # the innermost module running (None: outside any)
    call: int
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    #: the position of the first save of this forward over the same storage, or -1
    alias: int
    site: Site | None = None
    row: Row | None = None
    op: str = ""
    reason: str = ""
    #: a SHARED move's entry: that of the move at this position
    shares: int = -1
    #: a SHARED move's shape when it differs from the shared entry's
    reshape: tuple[int, ...] | None = None
    #: bytes this save added to its row (stock's, stored, held)
    raw: int = 0
    stored: int = 0
    held: int = 0
    #: a later SHARED move shares this one's entry: its dedupe key is checked
    keyed: bool = False
    #: a PARAM move's storage address (the same storage is the same parameter or buffer)
    base: int = -1

    def signature(self) -> tuple[Any, ...]:
        owner = self.owner() if self.owner is not None else None
        return (
            self.kind,
            id(owner),
            self.call,
            tuple(self.shape),
            self.dtype,
            self.device,
            self.requires_grad,
            self.alias,
            self.row.module if self.row is not None else None,
            self.op,
            self.reason,
            self.shares,
            self.reshape,
            self.raw,
            self.stored,
            self.held,
        )


@dataclass(slots=True, eq=False)
class Recorder:
    """The moves of the forward being recorded (one per save, in order)."""

    moves: list[Move] = field(default_factory=list)
    bases: dict[int, int] = field(default_factory=dict)
    #: False once a save was decided in a way that does not replay
    replayable: bool = True
    #: the entry of each move, while recording (to find a SHARED move's target)
    entries: list[Entry | None] = field(default_factory=list)

    def alias(self, t: torch.Tensor) -> int:
        """The position of the first save of this forward over ``t``'s storage, or -1."""
        if t.numel() == 0:
            return -1
        return self.bases.setdefault(storage_base(t), len(self.moves))

    def note(self, move: Move, entry: Entry | None) -> None:
        if move.alias == len(self.moves):
            move.alias = -1
        self.moves.append(move)
        self.entries.append(entry)

    def refuse(self) -> None:
        self.replayable = False


@dataclass(slots=True, eq=False)
class Trace:
    """Two recorded forwards that agreed: what each save of the next ones gets."""

    moves: tuple[Move, ...]
    #: per row, what a whole replayed forward adds: (saved, shared, raw, stored, held, ops,
    #: declined, param refs)
    totals: list[tuple[Row, int, int, int, int, int, dict[str, int], dict[str, int]]]
    param_refs: int
    #: the tally's generation its rows belong to
    generation: int


class Replayer:
    """The engine's record of decisions and its replay (a part the engine is composed of)."""

    def __init__(self, tally: Tally, state: Callable[[], set[int]]) -> None:
        self.tally = tally
        #: the parameters' and buffers' addresses (read when a save needs them)
        self.state = state
        self.trace: Trace | None = None
        #: False: every forward takes the full path (see :meth:`miss`)
        self.enabled = True
        self._last: tuple[tuple[Any, ...], ...] | None = None
        #: forwards run through the full path / replayed, since the engine was made
        self.recorded = 0
        self.replayed = 0
        self.missed = 0
        #: guard misses since the last whole replayed forward; at :data:`MAX_MISSES` the
        #: engine stops replaying (a model whose saves change every step or two)
        self.misses_in_a_row = 0

    # -- recording ---------------------------------------------------------------------------

    def finish_recording(self, rec: Recorder, generation: int) -> None:
        """A recorded forward ended: two in a row that agree, and replay well, make the
        trace the next forwards follow."""
        self.recorded += 1
        if not rec.replayable or not rec.moves or not self.enabled:
            self._last = None
            return
        for move in rec.moves:
            if move.kind == SHARED:
                rec.moves[move.shares].keyed = True
        signature = tuple(m.signature() for m in rec.moves)
        if signature != self._last:
            self._last = signature
            return
        self.trace = Trace(tuple(rec.moves), *_totals(rec.moves), generation)

    def rebind(self, trace: Trace) -> Trace:
        """The trace with its rows looked up again in the tally (reset since it was made)."""
        tally = self.tally
        for m in trace.moves:
            if m.row is not None:
                row = tally.rows.get(m.row.module)
                if row is None:
                    row = tally.rows[m.row.module] = Row(m.row.module, m.row.module_type)
                m.row = row
        self.trace = Trace(trace.moves, *_totals(list(trace.moves)), tally.generation)
        return self.trace

    def forget(self) -> None:
        """Record again from the next forward (a guard missed, or the engine was told to)."""
        self.trace = None
        self._last = None

    def miss(self) -> None:
        """A replayed forward left its trace: record again, or after :data:`MAX_MISSES` in a
        row, not replay any more."""
        self.missed += 1
        self.misses_in_a_row += 1
        self.forget()
        if self.misses_in_a_row >= MAX_MISSES:
            self.enabled = False

    # -- replaying ---------------------------------------------------------------------------

    def pack(self, t: torch.Tensor, tls: ThreadState) -> Saved | None:
        """The replayed save at the forward's next position, or None on a guard miss."""
        trace = tls.replaying
        assert trace is not None
        i = tls.position
        tls.position = i + 1
        moves = trace.moves
        if i >= len(moves):
            return None
        m = moves[i]
        frames = tls.frames
        owner = m.owner
        if frames:
            frame = frames[-1]
            if owner is None or owner() is not frame.owner or frame.call != m.call:
                return None
        elif owner is not None:
            return None
        if (
            t.shape != m.shape
            or t.dtype != m.dtype
            or t.requires_grad != m.requires_grad
            or t.device != m.device
        ):
            return None
        alias = base = -1
        if t.numel():
            base = storage_base(t)
            alias = tls.bases.setdefault(base, i)
            if alias == i:
                alias = -1
        if alias != m.alias:
            return None
        kind = m.kind
        if kind == SHARED:
            hit = tls.entries.get(m.shares)
            if hit is None or tls.keys[m.shares] != dedupe_key(t):
                return None
            hit.pending += 1
            return Saved(hit, m.reshape)
        site = m.site
        assert site is not None
        if kind == PARAM:
            if base != m.base and not _is_state(t, self.state):
                return None
            return Saved(Entry.kept(t.detach(), site, t._version))
        entry = Entry.kept(t.detach(), site, t._version)
        entry.reason = m.reason
        entry.pending = 1
        graph = tls.graph
        if graph is not None:
            entry.graph = graph
            graph.entries.append(weakref.ref(entry))
        if m.keyed:  # a later save shares it
            tls.entries[i] = entry
            tls.keys[i] = dedupe_key(t)
        return Saved(entry)

    def finish_replay(self, tls: ThreadState) -> bool:
        """A replayed forward ended: count what it saved. False when it saved other than
        the trace says (fewer saves): the next forward records again."""
        trace = tls.replaying
        assert trace is not None
        done = tls.position
        tally = self.tally
        if done == len(trace.moves):
            for row, saved, shared, raw, stored, held, ops, declined in trace.totals:
                row.saved += saved
                row.shared += shared
                row.raw_bytes += raw
                row.stored_bytes += stored
                row.held_bytes += held
                counts = row.ops
                for op, n in ops.items():
                    counts[op] += n
                if declined:
                    counts = row.declined
                    for reason, n in declined.items():
                        counts[reason] += n
            tally.param_refs += trace.param_refs
            self.replayed += 1
            self.misses_in_a_row = 0
            return True
        self.count_prefix(trace, min(done, len(trace.moves)))
        self.miss()
        return False

    def count_prefix(self, trace: Trace, n: int) -> None:
        """Count the first ``n`` replayed saves (a forward that left its trace there)."""
        tally = self.tally
        for m in trace.moves[:n]:
            if m.kind == PARAM:
                tally.param_refs += 1
                continue
            row = m.row
            assert row is not None
            row.saved += 1
            row.ops[m.op or "?"] += 1
            if m.kind == SHARED:
                row.shared += 1
                continue
            row.raw_bytes += m.raw
            row.stored_bytes += m.stored
            row.held_bytes += m.held
            if m.reason:
                row.declined[m.reason] += 1


def _is_state(t: torch.Tensor, state: Callable[[], set[int]]) -> bool:
    """A parameter save of the trace is still a parameter (or a view of one) or a tensor
    over a parameter's or buffer's storage."""
    if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
        return True
    base = t._base
    if base is not None and base.requires_grad and base.is_leaf:
        return True
    return storage_base(t) in state() or parameter_copy(t, ())


def _totals(
    moves: list[Move],
) -> tuple[list[tuple[Row, int, int, int, int, int, dict[str, int], dict[str, int]]], int]:
    """Per row, what one whole forward of ``moves`` adds to the tally."""
    acc: dict[int, list[Any]] = {}
    params = 0
    for m in moves:
        if m.kind == PARAM:
            params += 1
            continue
        assert m.row is not None
        a = acc.setdefault(id(m.row), [m.row, 0, 0, 0, 0, 0, {}, {}])
        a[1] += 1
        ops: dict[str, int] = a[6]
        ops[m.op or "?"] = ops.get(m.op or "?", 0) + 1
        if m.kind == SHARED:
            a[2] += 1
            continue
        a[3] += m.raw
        a[4] += m.stored
        a[5] += m.held
        if m.reason:
            declined: dict[str, int] = a[7]
            declined[m.reason] = declined.get(m.reason, 0) + 1
    return [tuple(a) for a in acc.values()], params


__all__ = ["KEEP", "MISSED_REASON", "PARAM", "SHARED", "Move", "Recorder", "Replayer"]
