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

What replays: a parameter, a tensor stored as is (with its reason, ``min_bytes`` say), a
second save of one of those, and a code whose compressor says it ``replays`` (it reads nothing
of the op call: memsave's ReLU mask, the sign bits), an output recomputed from a code
where :mod:`.rederive` can check its recipe, and a fused attention's output and log-sum-exp,
recomputed from its ``q``, ``k``, ``v``, where :mod:`.attention` can check its call. The saves
that read the op's arguments (a written-out attention's codes and recipes, a GELU's
derivative code, a masked fused attention) are decided again by the full path each step, in
the module calls around them (:mod:`.regions`); the rest of such a forward replays. A trace
whose every move keeps a tensor as it is runs with no hook at all once it has replayed whole
(:mod:`.hookless`). A replayed forward counts in the tally what its recording counted, row by row (exact for the
same saves over the same storage sharing within the step, as in a training loop; a storage
held across steps by a live graph is counted as the recording counted it).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..compressor import Compressor, Encoder, replays_next
from ..packed import Packed, storage_base
from ..site import Site
from . import attention
from .attention import Attend
from .entries import Entry, Graph, Recomputed, Saved, dedupe_key
from .hookless import CHECK_EVERY, Call
from .params import parameter_copy
from .rederive import Rederive, rebuild
from .regions import Key, Region, place
from .tally import Row
from .totals import Totals, diff, snapshot

if TYPE_CHECKING:
    from .tally import Tally


class ReplayState(Protocol):
    """What a replayed forward keeps per thread (:class:`~.scope.ThreadState`)."""

    frames: list[Any]
    graph: Graph | None
    replaying: Trace | None
    position: int
    bases: FirstSaves
    entries: dict[int, Entry]
    keys: dict[int, tuple[Any, ...]]
    nodes: dict[int, Any]
    attention: attention.Call

    @property
    def region(self) -> object | None: ...  # the region running down the full path


#: what a move does with its save (ATTEND: a fused attention's output, :mod:`.attention`)
PARAM, KEEP, SHARED, CODE, DERIVE, ATTEND = "param", "keep", "shared", "code", "derive", "attend"

#: guard misses in a row after which an engine stops replaying
MAX_MISSES = 3

#: after two recorded forwards in a row that could not replay, one forward in this many records
RETRY_EVERY = 64

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
    #: the row it is counted in (None: a parameter's)
    row: Row | None = None
    op: str = ""
    reason: str = ""
    #: a CODE move's compressor and variant, and the type of the saved tensor's autograd
    #: node (for an op's own output, the op's: a code is never replayed onto another op's
    #: save of the same shape in the same module)
    compressor: Compressor | None = None
    variant: str = ""
    node: type | None = None
    #: a CODE or DERIVE move's strides (a code's grouping may follow the layout), and the
    #: layout its restore gives back (:func:`~torchstash.layout.dense_strides` of them)
    strides: tuple[int, ...] = ()
    dense: tuple[int, ...] | None = None
    #: a CODE move's payload bytes: a replayed code of other bytes (a 1-bit code widened to
    #: 2 bits for a NaN) is a guard miss, kept exact, as its totals would not hold
    code_bytes: int = -1
    #: a SHARED move's entry: that of the move at this position
    shares: int = -1
    #: a SHARED move's shape when it differs from the shared entry's
    reshape: tuple[int, ...] | None = None
    #: bytes this save added to its row (stock's, stored, held), for a forward that leaves
    #: its trace part way (a whole one counts its recording's totals)
    raw: int = 0
    stored: int = 0
    held: int = 0
    #: a later SHARED move shares this one's entry: its dedupe key is checked
    keyed: bool = False
    #: a PARAM move's storage address (the same storage is the same parameter or buffer),
    #: and whether it was a copy of a frozen parameter (autocast's, made anew each step)
    base: int = -1
    copy: bool = False
    #: a DERIVE move's recipe and checks (:mod:`.rederive`)
    derive: Rederive | None = None
    #: a later DERIVE move reads this one's entry (its operand or a statistic)
    feeds: bool = False
    #: an ATTEND move's record, and for a CODE move, whether a later ATTEND move reads it
    #: (a fused attention's ``q``, ``k`` or ``v``: turned back into its tensor on a miss)
    attend: Attend | None = None
    attends: bool = False
    #: while recording: the module calls running (outermost first), the positions of the
    #: saves this one shares or is recomputed from, whether its decision read the op call
    #: (it needs a region: :mod:`.regions`) and whether it turned a code back into its
    #: tensor
    stack: tuple[Any, ...] = ()
    deps: tuple[int, ...] = ()
    needs_call: bool = False
    turned: bool = False
    #: in a region: the full path decides it again, and must decide what it decided
    #: (:func:`.regions.decided`)
    full: bool = False
    decided: tuple[Any, ...] = ()
    #: a CODE move's encoder (:func:`~torchstash.compressor.encoder_of`), made on its first
    #: replayed save
    encode: Encoder | None = None
    #: the position of the innermost module call running, among the forward's calls
    at: int = -1

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
            id(self.compressor),
            self.variant,
            self.node,
            self.strides,
            self.code_bytes,
            self.shares,
            self.reshape,
            self.copy,
            self.derive.signature() if self.derive is not None else None,
            self.attend.signature() if self.attend is not None else None,
            self.raw,
            self.stored,
            self.held,
            self.deps,
            self.full,
            self.decided,
        )


class FirstSaves:
    """The first save of a forward over each storage, by address: what a later save's
    ``alias`` names. A coded save does not keep its tensor: once that storage is freed its
    address may hold another tensor's, which is then no alias of it."""

    __slots__ = ("bases", "coded")

    def __init__(self) -> None:
        self.bases: dict[int, int] = {}
        self.coded: dict[int, weakref.ref[Any]] = {}

    def first(self, base: int, position: int) -> int:
        """The position of the first live save over the storage at ``base`` (``position``
        when this save is the first)."""
        j = self.bases.setdefault(base, position)
        if j != position:
            ref = self.coded.get(j)
            if ref is not None and ref() is None:
                self.bases[base] = position
                return position
        return j

    def code(self, position: int, t: torch.Tensor) -> None:
        """The save at ``position`` was coded or recomputed (its entry holds no tensor): its
        storage is an alias target while it lives."""
        if t.numel():
            self.coded[position] = weakref.ref(t.untyped_storage())


@dataclass(slots=True, eq=False)
class Recorder:
    """The moves of the forward being recorded (one per save, in order)."""

    #: the tally as the forward found it (its rows' counts, its generation, parameters)
    before: dict[str, tuple[Any, ...]]
    generation: int
    param_refs: int
    moves: list[Move] = field(default_factory=list)
    firsts: FirstSaves = field(default_factory=FirstSaves)
    #: False once a save was decided in a way that does not replay
    replayable: bool = True
    #: the entry of each move, while recording, and each entry's position (a SHARED move's
    #: target)
    entries: list[Entry | None] = field(default_factory=list)
    positions: dict[int, int] = field(default_factory=dict)
    #: the autograd node of each move's tensor (a recomputed save's recipe may read one
    #: recomputed itself: a LayerNorm's output from a GELU's, which the LayerNorm saves)
    nodes: dict[int, Any] = field(default_factory=dict)
    #: the module calls of the forward, in order, and its root call's key
    #: (:mod:`.hookless`)
    calls: list[Call] = field(default_factory=list)
    root: tuple[Any, ...] | None = None
    #: by call position, the moves and the calls made when that call returned
    ends: dict[int, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def start(cls, tally: Tally) -> Recorder:
        return cls(snapshot(tally), tally.generation, tally.param_refs)

    def alias(self, t: torch.Tensor) -> int:
        """The position of the first save of this forward over ``t``'s storage, or -1."""
        if t.numel() == 0:
            return -1
        return self.firsts.first(storage_base(t), len(self.moves))

    def note(self, move: Move, entry: Entry | None) -> None:
        if move.alias == len(self.moves):
            move.alias = -1
        if entry is not None:
            self.positions.setdefault(id(entry), len(self.moves))
        self.moves.append(move)
        self.entries.append(entry)

    def position(self, entry: Entry) -> int:
        """The position of the move that stored ``entry``, or -1 (the entries live as long
        as the recorder: their ids are theirs)."""
        return self.positions.get(id(entry), -1)

    def position_of_value(self, value: torch.Tensor) -> int:
        """The position of the move whose entry holds ``value`` as is (a statistic), or -1."""
        for i in range(len(self.entries) - 1, -1, -1):
            entry = self.entries[i]
            if entry is not None and entry.value is value:
                return i
        return -1

    def sources_of(self, value: Recomputed) -> tuple[int, ...]:
        """The positions of the saves a recomputed value reads: its operands' and its
        statistics' (-1 for one this forward did not store)."""
        operands = tuple(self.position(e) for e, _ in value.sources)
        return operands + tuple(self.position_of_value(s) for s in value.recipe.stats)

    def refuse(self) -> None:
        self.replayable = False

    def mark_late(self) -> None:
        """A save its op kept as is and then, once the op returned, made a recipe (a fused
        attention's output, over the ``q``, ``k``, ``v`` it stored): rebuilt on a replay where
        :mod:`.attention` can check its call, else made again by the full path only, in the
        region of what it is recomputed from."""
        calls: dict[int, list[int]] = {}  # a call's replay -> the positions of its outputs
        for i, (move, entry) in enumerate(zip(self.moves, self.entries, strict=True)):
            if entry is None or move.kind != KEEP or not isinstance(entry.value, Recomputed):
                continue
            deps = self.sources_of(entry.value)
            if min(deps, default=0) < 0:
                self.refuse()
                return
            move.deps, move.needs_call = deps, True
            replay = entry.value.recipe.arguments.get("replay")
            if replay is not None and not any(self.moves[p].needs_call for p in deps):
                calls.setdefault(id(replay), []).append(i)
        for outputs in calls.values():
            values, saved = [], []
            for i in outputs:
                entry = self.entries[i]
                assert entry is not None and isinstance(entry.value, Recomputed)
                values.append(entry.value)
                saved.append(self.nodes.get(i))
            deps = self.moves[outputs[0]].deps
            same = all(self.moves[i].deps == deps for i in outputs)
            recorded = attention.record(values, saved, deps, self.nodes) if same else None
            if recorded is None:
                continue  # made again by the full path, in a region
            for i, node, attend in zip(outputs, saved, recorded, strict=True):
                move, entry = self.moves[i], self.entries[i]
                assert entry is not None
                move.kind, move.attend, move.needs_call = ATTEND, attend, False
                move.compressor, move.node = entry.compressor, type(node)

    def restate(self, entry: Entry, stored: int, held: int) -> None:
        """The entry a move stored now holds other bytes (a fused attention's output became
        a recipe, a code its tensor): the move counts what its row holds now, and no reason
        it was kept for (a forward that leaves its trace part way counts moves one by one)."""
        position = self.position(entry)
        if position < 0:
            return
        move = self.moves[position]
        move.stored += stored
        move.held += held
        move.reason = entry.reason

    def settle(self) -> bool:
        """Bring each move up to what became of its entry later in the forward (a code a
        later save of the same tensor turned back into the tensor is a KEEP); False when an
        entry became something a replay cannot make."""
        for move, entry in zip(self.moves, self.entries, strict=True):
            if entry is None or move.kind in (PARAM, SHARED) or move.full:
                continue
            value = entry.value
            if entry.compressor is None and isinstance(value, torch.Tensor):
                if move.kind in (CODE, DERIVE):
                    move.kind, move.compressor, move.variant = KEEP, None, ""
                    move.derive = None
                continue
            if move.kind in (DERIVE, ATTEND):
                if not isinstance(value, Recomputed) or entry.compressor is not move.compressor:
                    return False
                continue
            if move.kind != CODE or entry.compressor is not move.compressor:
                return False
            if not isinstance(value, Packed):
                return False
        return True


@dataclass(slots=True, eq=False)
class Trace:
    """Two recorded forwards that agreed: what each save of the next ones gets."""

    moves: tuple[Move, ...]
    #: per row, what a whole replayed forward adds
    totals: list[Totals]
    param_refs: int
    #: the compressors of its codes that may send a forward down the full path
    #: (``replays_next``: an allocation coming)
    askers: tuple[Compressor, ...] = ()
    #: the module calls it leaves to the full path (:mod:`.regions`)
    regions: dict[Key, Region] = field(default_factory=dict)
    #: its module calls and root key, and whether it may run with no hook (every move keeps
    #: a tensor as it is: :mod:`.hookless`)
    calls: tuple[Call, ...] = ()
    root: tuple[Any, ...] | None = None
    lean: bool = False
    #: in a hookless forward, the module calls that run with the hooks on, replayed behind
    #: every save's guard: call position -> (first move, end move, the module's call number)
    islands: dict[int, tuple[int, int, int]] = field(default_factory=dict)

    def may_replay(self) -> bool:
        """Whether the next forward may follow it (each asker agrees)."""
        return all(replays_next(c) for c in self.askers)


#: ``code(t, move)``: the engine's compress of ``t`` by a CODE move's compressor at its site
#: (its errors named as the full path names them), or None when it declined
Coder = Callable[[torch.Tensor, Move], "Packed | None"]


class Replayer:
    """The engine's record of decisions and its replay (a part the engine is composed of)."""

    def __init__(self, tally: Tally, state: Callable[[], set[int]], code: Coder) -> None:
        self.tally = tally
        #: the parameters' and buffers' addresses (read when a save needs them)
        self.state = state
        self.code = code
        self.trace: Trace | None = None
        #: False: every forward takes the full path (see :meth:`miss`)
        self.enabled = True
        self._last: tuple[Any, ...] | None = None
        #: forwards recorded (the full path, its moves noted), replayed, and left part way
        self.recorded = 0
        self.replayed = 0
        self.missed = 0
        #: guard misses since the last whole replayed forward; at :data:`MAX_MISSES` the
        #: engine stops replaying (a model whose saves change every step or two)
        self.misses_in_a_row = 0
        #: recorded forwards in a row that could not replay (a code that reads the op call)
        self.refused_in_a_row = 0
        self._forwards = 0
        #: hookless forwards (:mod:`.hookless`); False once a check found saves no module
        #: call shows changing; whether the trace replayed whole behind its guards; and the
        #: forwards that might have gone hookless (one in :data:`CHECK_EVERY` is a check)
        self.hookless = 0
        self.may_go_hookless = True
        self.steady = False
        self._candidates = 0
        self._checking = False

    def bind(self, tally: Tally, state: Callable[[], set[int]], code: Coder) -> None:
        """Serve the engine these belong to (a replayer shared by the engines of one plan's
        ``stash`` blocks counts in each block's own tally)."""
        self.tally, self.state, self.code = tally, state, code

    # -- recording ---------------------------------------------------------------------------

    def wants_recording(self) -> bool:
        """Whether the next full-path forward records its moves: after two in a row that
        could not replay, one in :data:`RETRY_EVERY` (a quant model's forwards would only pay
        for a record they throw away)."""
        self._forwards += 1
        return self.refused_in_a_row < 2 or self._forwards % RETRY_EVERY == 0

    def finish_recording(self, rec: Recorder) -> None:
        """A recorded forward ended: two in a row that agree, and replay well, make the
        trace the next forwards follow."""
        self.recorded += 1
        tally = self.tally
        rec.mark_late()
        regions = place(rec.moves) if rec.replayable else None
        for move in rec.moves:
            move.stack = ()  # the frames hold the modules
        if (
            regions is None
            or not rec.moves
            or not self.enabled
            or tally.generation != rec.generation  # reset mid-forward: no totals to take
            or not rec.settle()
        ):
            self._last = None
            self.refused_in_a_row += 1
            return
        self.refused_in_a_row = 0
        for move in rec.moves:
            if move.full:
                continue  # the full path shares and rebuilds: nothing handed over
            if move.kind == SHARED:
                rec.moves[move.shares].keyed = True
            elif move.derive is not None:
                for p in (move.derive.source, *move.derive.stats):
                    rec.moves[p].feeds = True
            elif move.attend is not None:
                for p in move.attend.sources:
                    rec.moves[p].feeds = True
                    rec.moves[p].attends = rec.moves[p].kind == CODE
        totals = diff(rec.before, tally)
        param_refs = tally.param_refs - rec.param_refs
        signature = (
            tuple(m.signature() for m in rec.moves),
            tuple(t.signature() for t in totals),
            param_refs,
            tuple(sorted(regions)),
            tuple((id(c[0]()), *c[1:]) for c in rec.calls),
        )
        if signature != self._last:
            self._last = signature
            return
        askers = {
            id(m.compressor): m.compressor
            for m in rec.moves
            if m.compressor is not None and hasattr(m.compressor, "replays_next")
        }
        islands = None if regions or askers or not rec.calls else hooked_calls(rec)
        self.trace = Trace(
            tuple(rec.moves),
            totals,
            param_refs,
            tuple(askers.values()),
            regions,
            tuple(rec.calls),
            rec.root,
            islands is not None,
            islands or {},
        )
        self.steady = False

    def forget(self) -> None:
        """Record again from the next forward (a guard missed, or the engine was told to)."""
        self.trace = None
        self._last = None
        self.steady = False
        self._checking = False

    def goes_hookless(self, trace: Trace, root: Callable[[], tuple[Any, ...]]) -> bool:
        """Whether this forward follows ``trace`` with no hook (:mod:`.hookless`): a lean
        trace that replayed whole behind its guards, the root's key as recorded, and not
        the one forward in :data:`CHECK_EVERY` that checks it behind them again."""
        self._checking = False
        if not (trace.lean and self.steady and self.may_go_hookless):
            return False
        if root() != trace.root:
            return False  # another batch shape, say: the guarded replay (or a miss)
        self._candidates += 1
        if self._candidates % CHECK_EVERY == 0:
            self._checking = True
            return False
        return True

    def miss(self) -> None:
        """A replayed forward left its trace: record again, or after :data:`MAX_MISSES` in a
        row, not replay any more. A check of a hookless trace that misses ends hookless
        forwards (:mod:`.hookless`)."""
        if self._checking:
            self._checking = False
            self.may_go_hookless = False
        self.missed += 1
        self.misses_in_a_row += 1
        self.forget()
        if self.misses_in_a_row >= MAX_MISSES:
            self.enabled = False

    # -- replaying ---------------------------------------------------------------------------

    def pack(self, t: torch.Tensor, tls: ReplayState) -> Saved | Move | None:
        """The replayed save at the forward's next position, or None on a guard miss, or its
        move when the full path decides it (in a region: :mod:`.regions`)."""
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
            alias = tls.bases.first(base, i)
            if alias == i:
                alias = -1
        if alias != m.alias:
            return None
        if m.full:
            return m if tls.region is not None else None
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
            if (
                base != m.base
                and not (m.copy and t.grad_fn is None)
                and not is_state(t, self.state)
            ):
                return None
            return Saved(Entry.kept(t.detach(), site, t._version))
        if kind == CODE:
            if type(t.grad_fn) is not m.node or t.stride() != m.strides:
                return None
            packed = self.code(t, m)
            if packed is None or packed.nbytes() != m.code_bytes:
                return None
            tls.bases.code(i, t)
            entry = Entry.coded(packed, m.compressor, site, t, m.variant)
            entry.strides = m.dense
            if m.attends:  # read by a fused attention not checked yet
                tls.attention.hold(entry, t, m.stored, m.held)
        elif kind in (DERIVE, ATTEND):
            rebuilt = self._rederive(t, m, tls) if kind == DERIVE else self._attend(t, m, tls)
            if rebuilt is None:
                return None
            tls.bases.code(i, t)
            entry = rebuilt
        else:
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
        if m.feeds:  # a later recomputed save reads it
            tls.entries[i] = entry
            tls.nodes[i] = t.grad_fn
        return Saved(entry)

    def _rederive(self, t: torch.Tensor, m: Move, tls: ReplayState) -> Entry | None:
        """A DERIVE move's entry: ``t`` kept as its recipe over this step's operand, the
        compressor told (a budget counts it), or None on a guard miss."""
        d, site = m.derive, m.site
        assert d is not None and site is not None
        if type(t.grad_fn) is not m.node or t.stride() != m.strides:
            return None
        value = rebuild(d, t, tls.entries, tls.nodes, self.state)
        if value is None:
            return None
        entry = _recomputed(value, m.compressor, site, t, m.variant)
        entry.strides = m.dense
        return entry

    def _attend(self, t: torch.Tensor, m: Move, tls: ReplayState) -> Entry | None:
        """An ATTEND move's entry: ``t`` kept as its recipe over this step's ``q``, ``k``,
        ``v``, the compressor told (a budget counts it), or None on a guard miss."""
        a, site = m.attend, m.site
        assert a is not None and site is not None
        call = tls.attention
        value = attention.rebuild(a, t, tls.entries, tls.nodes, call)
        if value is None:
            return None
        entry = _recomputed(value, m.compressor, site, t, "")
        if a.last:  # the call was checked: what it reads stays as made
            call.replay = call.node = call.unchecked = None
        elif call.node is None:  # made before the call's node was checked
            call.hold(entry, t, m.stored, m.held)
        return entry

    def finish_replay(self, tls: ReplayState) -> bool:
        """A replayed forward ended: count what it saved. False when it saved other than
        the trace says (fewer saves): the next forward records again."""
        trace = tls.replaying
        assert trace is not None
        done = tls.position
        if done == len(trace.moves):
            self.count_whole(trace)
            self.steady = True
            self._checking = False
            return True
        self.count_prefix(trace, min(done, len(trace.moves)))
        self.miss()
        return False

    def count_whole(self, trace: Trace) -> None:
        """A forward made every save of ``trace``: count its totals."""
        tally = self.tally
        tally.add_forward(trace.totals)
        tally.param_refs += trace.param_refs
        self.replayed += 1
        self.misses_in_a_row = 0

    def count_prefix(self, trace: Trace, n: int) -> None:
        """Count the first ``n`` replayed saves (a forward that left its trace there)."""
        tally = self.tally
        for m in trace.moves[:n]:
            if m.kind == PARAM:
                tally.param_refs += 1
                continue
            assert m.row is not None
            row = tally.rows.get(m.row.module)
            if row is None:
                row = tally.rows[m.row.module] = Row(m.row.module, m.row.module_type)
            row.saved += 1
            row.ops[m.op or "?"] += 1
            if m.kind == SHARED:
                row.shared += 1
                continue
            row.raw_bytes += m.raw
            row.stored_bytes += m.stored
            row.held_bytes += m.held
            if m.kind == CODE:
                row.compressed += 1
            elif m.kind in (DERIVE, ATTEND):
                row.derived += 1
            if m.reason:
                row.declined[m.reason] += 1


def _recomputed(
    value: Recomputed, compressor: Compressor | None, site: Site, t: torch.Tensor, variant: str
) -> Entry:
    """A replayed save's entry kept as ``value``, a recipe over this step's entries, its
    compressor told (``derived``: a budget counts it) as the full path tells it."""
    told = getattr(compressor, "derived", None)
    if told is not None:
        told(t, site, [source.site for source, _ in value.sources])
    return Entry.coded(value, compressor, site, t, variant)


def hooked_calls(rec: Recorder) -> dict[int, tuple[int, int, int]] | None:
    """The module calls a hookless forward of ``rec`` runs with the hooks on (its
    :attr:`Trace.islands`), or None when it cannot go hookless. A move that keeps no tensor as
    it is (a code, a recomputed output) needs its save's hook: its innermost module call gets
    the hooks, when that call runs no module inside it, is not the root, and its saves read no
    save made outside it (a storage shared with one, an operand), and no save outside it reads
    one of its own; those calls hold at most half the forward's saves."""
    moves, calls = rec.moves, rec.calls
    islands: dict[int, tuple[int, int, int]] = {}
    for m in moves:
        if m.full:
            return None
        if m.kind in (PARAM, KEEP, SHARED) or m.at in islands:
            continue
        p = m.at
        if p <= 0 or p not in rec.ends:
            return None  # outside any module, in the root's own code, or never returned
        end, made = rec.ends[p]
        if made != p + 1:
            return None  # a module call runs inside it
        owner = calls[p][0]()
        number = sum(1 for c in calls[:p] if c[0]() is owner)
        islands[p] = (calls[p][3], end, number)
    inside = [False] * len(moves)
    for start, end, _ in islands.values():
        inside[start:end] = [True] * (end - start)
    for start, end, _ in islands.values():
        for m in moves[start:end]:
            reads = (m.alias, *m.deps) if m.kind != SHARED else (m.alias, m.shares, *m.deps)
            if any(0 <= r < start for r in reads):
                return None
    for j, m in enumerate(moves):
        if not inside[j] and m.kind == SHARED and inside[m.shares]:
            return None
    if 2 * sum(inside) > len(moves):
        return None
    return islands


def is_state(t: torch.Tensor, state: Callable[[], set[int]]) -> bool:
    """A parameter save of the trace is still a parameter (or a view of one) or a tensor
    over a parameter's or buffer's storage."""
    if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
        return True
    base = t._base
    if base is not None and base.requires_grad and base.is_leaf:
        return True
    return storage_base(t) in state() or parameter_copy(t, ())


__all__ = [
    "ATTEND",
    "CODE",
    "DERIVE",
    "KEEP",
    "MISSED_REASON",
    "PARAM",
    "SHARED",
    "Move",
    "Recorder",
    "Replayer",
]
