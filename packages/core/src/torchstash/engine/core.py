"""The engine: saved-tensor hooks that compress what autograd saves, with exact accounting.

One :class:`Engine` serves one ``apply`` handle or one ``stash`` block. Its pack hook names the
tensor's :class:`Site` (:mod:`.scope`), keeps parameters and their copies as they are
(:mod:`.params`), stores a tensor saved by several ops once, asks the policy for a
compressor, keeps an output its op's stored input can rebuild as a recipe (:mod:`.recompute`),
and counts raw and stored bytes per module (:mod:`.tally`); its unpack hook restores, and a
failing compressor's error names everything a user needs (:mod:`.messages`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..compressor import Compressor, encoder_of, replays_at
from ..derive import SDPA, Recipe, may_replay_attention, save_kind
from ..layout import dense_strides, with_layout
from ..optrack import STATE as OP_STATE
from ..packed import Packed, raw_nbytes, storage_base
from ..site import Site
from . import hookless, messages, rederive
from .entries import (
    RELEASED,
    Entry,
    Recomputed,
    Saved,
    dedupe_key,
    variant_of,
    with_call,
    without_call,
)
from .messages import CONSTANT_REASON, FUSED_EXACT_REASON, FUSED_OUTPUT_REASON, KEEP_TYPE
from .params import is_parameter
from .recompute import Recomputation, Sources
from .regions import decided
from .replay import (
    CODE,
    DERIVE,
    KEEP,
    MISSED_REASON,
    PARAM,
    SHARED,
    Move,
    Recorder,
    Replayer,
    is_state,
)
from .scope import Scoping, ThreadState, op_call
from .tally import Row, Tally
from .totals import diff, snapshot

Resolver = Callable[[Site, frozenset[str]], "Compressor | None"]

#: Tensors smaller than this are stored as they are: compressing them saves nothing worth a kernel.
DEFAULT_MIN_BYTES = 1024

_PARAMETER = Site(role="parameter")
_OUTSIDE = Site(role="outside the stash block")


class Engine(Scoping, Recomputation):
    def __init__(
        self,
        resolve: Resolver,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        skip_ptrs: Callable[[], set[int]] | None = None,
        dedupe: bool = True,
        in_scope: Callable[[], bool] | None = None,
        replayer: Replayer | None = None,
        names: messages.Naming | None = None,
        state_key: Callable[[], Any] | None = None,
    ) -> None:
        """``replayer``: one an earlier engine of the same plan recorded with (a ``stash``
        block is a new engine each step); it is bound to this one while it runs.
        ``state_key``: what of the model's parameters decides what autograd saves (which
        train), read before a forward that would run with no hook (:mod:`.hookless`)."""
        self.resolve = resolve
        #: who built each compressor, for the messages (the plan; None: a bare engine)
        self.names = names
        #: whether the running code is the engine's to compress (a ``stash`` block's own
        #: thread and context); None: whatever runs under its hooks
        self.in_scope = in_scope
        self.min_bytes = min_bytes
        self.dedupe = dedupe
        self._tally = Tally()
        #: the decisions of a recorded forward, replayed on the next ones (:mod:`.replay`)
        if replayer is None:
            replayer = Replayer(self._tally, self._state, self._replay_code)
        self.replayer = replayer
        self._skip_ptrs = skip_ptrs
        self._skip: set[int] = set()
        self._state_key = state_key
        #: whether a lean trace's forwards may run with no hook (an applied model's engine)
        self._hookless = hookless.enabled() and in_scope is None
        self._tls = ThreadState()
        self._live: dict[tuple[Any, ...], weakref.ref[Entry]] = {}
        self._live_limit = 1024
        #: outputs a later save may recompute: key -> (the output, its recipe, the operands'
        #: entries with their saved shapes)
        self._recipes: dict[tuple[Any, ...], tuple[weakref.ref[torch.Tensor], Recipe, Sources]] = {}

    def pack(self, t: torch.Tensor) -> Saved:
        """The pack hook: what autograd will hold for ``t`` (a handle to a possibly shared
        entry), with ``t`` counted in its module's row."""
        tls = self._tls
        if tls.replaying is not None:
            if self.in_scope is not None and not self.in_scope():
                return Saved(Entry(t.detach(), None, _OUTSIDE, t._version, None))
            saved = self.replayer.pack(t, tls)
            if type(saved) is Move:
                made = self._redo_in_region(t, tls, saved)
                return made if made is not None else self._decide_again(t, tls, saved)
            if saved is not None:
                assert isinstance(saved, Saved)
                if tls.region is not None:
                    self._op_position(tls)  # the region's later sites count this op call
                return saved
            self._missed(tls)
        if tls.missed:
            return self._keep_missed(t)
        return self._decide(t, tls)

    def _decide(self, t: torch.Tensor, tls: ThreadState) -> Saved:
        """The full path: what ``t`` gets, decided from its site and the op's call (noted as a
        move when recording)."""
        tls.shared = False
        rec = tls.recorder
        if rec is not None and not rec.replayable:
            rec = None
        if self.in_scope is not None and not self.in_scope():
            # Under this engine's hooks but outside its scope (another asyncio task on the
            # thread of a ``stash`` block): kept as stock keeps it, and not counted.
            if rec is not None:
                rec.refuse()
            return Saved(Entry(t.detach(), None, _OUTSIDE, t._version, None))
        if is_parameter(t, self._skip, OP_STATE.args):
            self.tally.param_refs += 1
            state = Entry(t.detach(), None, _PARAMETER, t._version, None)
            if rec is not None:
                move = self._move(PARAM, t, rec, _PARAMETER)
                move.base = storage_base(t) if t.numel() else -1
                # autocast's copy of a frozen weight: a new tensor each step, no graph
                move.copy = (
                    t.grad_fn is None
                    and not isinstance(t, torch.nn.Parameter)
                    and move.base not in self._skip
                )
                move.decided = decided(state, False)
                rec.note(move, state)
            return Saved(state)
        site = self._site(t)
        row = self.tally.row(site)
        row.saved += 1
        row.ops[site.op or "?"] += 1
        nbytes = raw_nbytes(t)
        compressor, reason = self._choose(t, site, nbytes)
        # a code that reads the op's arguments: its module call is left to the full path
        needs_call = (
            rec is not None and compressor is not None and not replays_at(compressor, t, site)
        )
        variant = variant_of(compressor, t, site)
        key = None
        if self.dedupe and t.numel() > 0:
            key = dedupe_key(t)
            ref = self._live.get(key)
            hit = ref() if ref is not None else None
            # Shared only when stored by the same compressor in the same way: an op-specific
            # code (a ReLU's sign mask) must not stand in for the tensor another op saved.
            # A tensor another op already holds as is is shared as is: a compressed copy
            # beside it would only add memory (a ReLU's output that a conv also saves).
            turned = False
            if hit is not None and hit.source() is not None and compressor is None:
                turned = hit.compressor is not None
                if rec is not None:
                    self._note_as_is(rec, hit, t)
                else:
                    self._store_as_is(hit, t)  # another op needs it as is: one raw copy
            if (
                hit is not None
                and hit.source() is not None
                and (
                    (hit.compressor is compressor and hit.variant == variant)
                    or hit.compressor is None
                )
            ):
                row.shared += 1
                tls.shared = True
                if hit.graph is not self._tls.graph:
                    hit.graph = None  # two passes hold it: a failed backward must not drop it
                self._note_derive_save(t, hit, compressor, site)
                shape = tuple(t.shape)  # the stored value (tensor or Packed) has its shape
                hit.pending += 1
                reshape = None if shape == tuple(hit.value.shape) else shape
                if rec is not None:
                    self._note_shared(rec, t, site, row, hit, reshape, needs_call, turned)
                return Saved(hit, reshape)
        entry = None
        if key is not None and compressor is not None and self._recipes:
            entry = self._recomputed(t, key, compressor, site, row)
        if entry is None:
            entry = self._store(t, site, row, compressor, reason)
        # a recomputed operand is a source too (``attn @ v``'s bf16 copy of a float32 map)
        self._note_derive_save(t, entry, compressor, site)
        before = (row.raw_bytes, row.stored_bytes, row.held_bytes)
        self._count(t, entry, row)
        entry.variant = variant
        if not isinstance(entry.value, torch.Tensor):
            entry.strides = dense_strides(t)
        graph = self._tls.graph
        if graph is not None:
            entry.graph = graph
            graph.entries.append(weakref.ref(entry))
        if key is not None:
            self._remember(key, entry)
        entry.pending += 1
        if rec is not None:
            value = entry.value
            derive = None
            deps: tuple[int, ...] = ()
            if isinstance(value, Recomputed):
                derive = rederive.record(value, t, rec, lambda a: is_state(a, self._state))
                if derive is None:  # its recipe reads what a replay cannot check
                    needs_call, deps = True, rec.sources_of(value)
                else:
                    deps = (derive.source, *derive.stats)
                if min(deps, default=0) < 0:
                    rec.refuse()  # recomputed from a save of an earlier forward
                    return Saved(entry)
                kind = DERIVE
            else:
                kind = CODE if isinstance(value, Packed) else KEEP
            move = self._move(kind, t, rec, entry.site, row, entry.reason)
            rec.nodes[len(rec.moves)] = t.grad_fn  # a later recipe's operand: its node
            # a code holds no tensor, and a tensor kept now may become a recipe when its op
            # returns (a fused attention's output): its storage may go
            rec.firsts.code(len(rec.moves), t)
            if kind != KEEP:
                move.compressor, move.variant = entry.compressor, variant
                move.node, move.strides = type(t.grad_fn), t.stride()
                move.dense = entry.strides
                move.derive = derive
            if isinstance(value, Packed):
                move.code_bytes = value.nbytes()
                recall = getattr(entry.compressor, "recall", None)
                if recall is not None:
                    move.site = dataclasses.replace(entry.site, recalled=recall(t, site))
            move.raw = row.raw_bytes - before[0]
            move.stored = row.stored_bytes - before[1]
            move.held = row.held_bytes - before[2]
            move.deps, move.needs_call = deps, needs_call
            move.decided = decided(entry, False)
            rec.note(move, entry)
        return Saved(entry)

    def _redo_in_region(self, t: torch.Tensor, tls: ThreadState, move: Move) -> Saved | None:
        """A save in a replayed region (:mod:`.regions`) made as its recording made it, with
        what reads the op call read from this call: a code's variant (which operand of an
        attention's matmul it is) must come out as recorded, and a recomputed save takes the
        recipe the op tracker carried this step (its scale, mask and softmax as called now)
        over the entries at the recorded positions. The full path's site, policy, dedupe and
        counting are not run again: the site is the recording's, the compressor its, and the
        trace's totals count a whole replayed forward. None where anything differs (or for a
        save this does not make: a fused attention's, a statistic's): the full path decides
        it and checks it against the recording (:meth:`_decide_again`)."""
        kind, site, compressor = move.kind, move.site, move.compressor
        if site is None or move.op == SDPA:
            return None
        if kind == KEEP:  # a statistic a recipe reads, a tensor its op saves as it is
            entry = Entry(t.detach(), None, site, t._version, t if self.dedupe else None)
            entry.reason = move.reason
            return self._made_in_region(
                t, tls, move, entry, with_call(site, op_call()), dedupe_key(t)
            )
        if kind == SHARED:
            hit = tls.entries.get(move.shares)
            key = dedupe_key(t)
            if (
                hit is None
                or move.turned
                or hit.source() is None
                or tls.keys.get(move.shares) != key
            ):
                return None
            self._op_position(tls)  # the region's later sites count this op call
            self._note_derive_save(t, hit, hit.compressor, with_call(site, op_call()))
            hit.pending += 1
            if hit.graph is not tls.graph:
                hit.graph = None  # two passes hold it: a failed backward must not drop it
            self._keep_for_later(t, tls, move, hit, key)
            return Saved(hit, move.reshape)
        if (
            kind not in (CODE, DERIVE)
            or compressor is None
            or type(t.grad_fn) is not move.node
            or t.stride() != move.strides
        ):
            return None
        live, key = with_call(site, op_call()), dedupe_key(t)
        if kind == CODE:
            if variant_of(compressor, t, live) != move.variant:
                return None
            value = self._compress(compressor, t, live)
            if not isinstance(value, Packed) or value.nbytes() != move.code_bytes:
                return None
            entry = Entry(
                value, compressor, live, t._version, t if self.dedupe else None, watched=t
            )
        else:
            if any(p not in tls.entries for p in move.deps):
                return None  # read from a save this step did not hold where recorded
            found = self._recipe_for(t, key, compressor, site)
            if found is None:
                return None
            recipe, sources = found
            reads = [e for e, _ in sources]
            if len(reads) + len(recipe.stats) != len(move.deps) or any(
                tls.entries.get(p) is not e for p, e in zip(move.deps, reads)
            ):
                return None  # recomputed from other saves than the recording's
            for p, stat in zip(move.deps[len(reads) :], recipe.stats):
                kept = tls.entries.get(p)
                if kept is None or kept.value is not stat:
                    return None
            self._derive(t, sources, compressor, site, self.tally.row(site))
            value = Recomputed(sources, recipe, t.shape)
            entry = Entry(value, compressor, site, t._version, t, watched=t)
        entry.variant = move.variant
        entry.strides = move.dense
        return self._made_in_region(t, tls, move, entry, live, key)

    def _made_in_region(
        self,
        t: torch.Tensor,
        tls: ThreadState,
        move: Move,
        entry: Entry,
        live: Site,
        key: tuple[Any, ...],
    ) -> Saved:
        """What the full path does with a region's new entry once it is made (see
        :meth:`_redo_in_region`): its op call counted, the recipes it sources told, the
        forward's graph and the dedupe table told, held for the saves after it."""
        self._op_position(tls)
        self._note_derive_save(t, entry, entry.compressor, live)
        graph = tls.graph
        if graph is not None:
            entry.graph = graph
            graph.entries.append(weakref.ref(entry))
        if self.dedupe and t.numel() > 0:
            self._remember(key, entry)
        entry.pending += 1
        tls.bases.code(tls.position - 1, t)
        self._keep_for_later(t, tls, move, entry, key)
        return Saved(entry)

    @staticmethod
    def _keep_for_later(
        t: torch.Tensor, tls: ThreadState, move: Move, entry: Entry, key: tuple[Any, ...]
    ) -> None:
        """A region's save, at hand for the saves after it that share it or are recomputed
        from it (by position, as the recording saw them)."""
        i = tls.position - 1
        tls.entries[i] = entry
        tls.keys[i] = key
        if move.feeds:
            tls.nodes[i] = t.grad_fn

    def _decide_again(self, t: torch.Tensor, tls: ThreadState, move: Move) -> Saved:
        """A save in a replayed region (:mod:`.regions`): the full path decides it, and must
        decide what the recording did; else a guard miss (this save counted as it went)."""
        i = tls.position - 1
        scratch = self.tally
        before = snapshot(scratch)
        saved = self._decide(t, tls)
        entry = saved.entry
        if decided(entry, tls.shared) != move.decided:
            counted = diff(before, scratch)
            self._missed(tls)
            self.tally.add_forward(counted)
            return saved
        self._keep_for_later(t, tls, move, entry, dedupe_key(t))  # the region's next saves read it
        if not tls.shared:
            tls.bases.code(i, t)
        return saved

    def _move(
        self,
        kind: str,
        t: torch.Tensor,
        rec: Recorder,
        site: Site | None = None,
        row: Row | None = None,
        reason: str = "",
    ) -> Move:
        """The recorded form of a save the full path just decided (see :mod:`.replay`)."""
        frames = self._tls.frames
        frame = frames[-1] if frames else None
        return Move(
            kind,
            weakref.ref(frame.owner) if frame is not None else None,
            frame.call if frame is not None else 0,
            t.shape,
            t.dtype,
            t.device,
            t.requires_grad,
            rec.alias(t),
            site,
            row,
            site.op if site is not None else "",
            reason,
            stack=tuple(self._tls.frames),
            at=frame.position if frame is not None else -1,
        )

    def _note_shared(
        self,
        rec: Recorder,
        t: torch.Tensor,
        site: Site,
        row: Row,
        hit: Entry,
        reshape: tuple[int, ...] | None,
        needs_call: bool,
        turned: bool,
    ) -> None:
        """Record a second save of an entry this forward stored (as is, or coded by the same
        compressor in the same variant); one stored before this forward: refused."""
        position = rec.position(hit)
        if position < 0 or rec.moves[position].kind == SHARED:
            rec.refuse()
            return
        move = self._move(SHARED, t, rec, without_call(site), row)  # a region's redo reads it
        move.op, move.shares, move.reshape = site.op, position, reshape
        move.deps, move.needs_call, move.turned = (position,), needs_call, turned
        move.decided = decided(hit, True)
        rec.note(move, None)

    def _note_as_is(self, rec: Recorder, hit: Entry, t: torch.Tensor) -> None:
        """:meth:`_store_as_is` while recording: the move that stored ``hit`` counts what its
        row holds now (a forward that leaves its trace part way counts moves one by one)."""
        row = self.tally.row(hit.site)
        before = (row.raw_bytes, row.stored_bytes, row.held_bytes)
        self._store_as_is(hit, t)
        position = rec.position(hit)
        if position < 0:
            return
        move = rec.moves[position]
        move.raw += row.raw_bytes - before[0]
        move.stored += row.stored_bytes - before[1]
        move.held += row.held_bytes - before[2]

    def _replay_code(self, t: torch.Tensor, move: Move) -> Packed | None:
        """A replayed CODE move: ``t`` coded by its compressor at its site, or None when the
        compressor declined it this time (a guard miss)."""
        compressor, site = move.compressor, move.site
        assert compressor is not None and site is not None
        out = self._compress(compressor, t, site, move)
        return out if isinstance(out, Packed) else None

    def _compress(
        self, compressor: Compressor, t: torch.Tensor, site: Site, move: Move | None = None
    ) -> Any:
        """``compressor.compress``, its failure an error that names the tensor, the site and
        the policy line. A replayed ``move`` calls its encoder (made on its first replay:
        :func:`~torchstash.compressor.encoder_of`)."""
        x = t.detach()
        try:
            if move is None:
                return compressor.compress(x, site)
            encode = move.encode
            if encode is None:
                encode = move.encode = encoder_of(compressor, x, site)
            return encode(x)
        except KEEP_TYPE as e:
            e.add_note(messages.compress_note(self.names, compressor, site, t))
            raise
        except Exception as e:
            raise messages.compress_error(self.names, compressor, site, t, e) from e

    def _missed(self, tls: ThreadState) -> None:
        """A replayed save missed its guard: the saves before it are counted as the trace
        says, it and the rest of the forward are kept as they are, and the next forward
        records again."""
        trace = tls.replaying
        assert trace is not None
        tls.scratch = None  # in a region: the rest counts in the engine's tally
        tls.counted = tls.position - 1
        self.replayer.count_prefix(trace, tls.counted)
        self.replayer.miss()
        tls.replaying = None
        tls.missed = True
        self._unattend(tls)
        cursor = tls.lean
        if cursor is not None and cursor.island is not None:  # a hookless forward's island
            hooks = cursor.island[2]
            cursor.island = None
            self._unlean(tls, hooks)

    def _unattend(self, tls: ThreadState) -> None:
        """A replayed forward left its trace inside a fused attention call, or ended in
        one: what was made of its saves before its node was checked (:mod:`.attention`: the
        codes of its ``q``, ``k``, ``v``, a log-sum-exp recomputed from them) is turned back
        into the tensors (still alive: the call's arguments and result), as the full path
        keeps a call it cannot replay, so no call reads codes of some beside exact others."""
        call = tls.attention
        unchecked = call.unchecked
        call.replay = call.node = call.unchecked = None
        for entry, t, stored, held in unchecked or ():
            value = entry.value
            tally = self.tally
            row = tally.row(entry.site)
            row.stored_bytes -= stored  # counted as the trace says: not held by its ledger
            row.held_bytes -= held
            if isinstance(value, Packed):
                row.compressed -= 1
                reason = FUSED_EXACT_REASON
            elif isinstance(value, Recomputed):
                row.derived -= 1
                for source, _ in value.sources:
                    source.pending -= 1
                reason = FUSED_OUTPUT_REASON
            else:
                continue
            exact = t.detach()
            entry.value = exact if exact.shape == value.shape else exact.view(value.shape)
            entry.compressor, entry.variant = None, ""
            tally.keep(row, exact, entry)
            if entry.watch is not None:
                tally.keep_alias(row, entry.watch)
            entry.reason = reason
            row.declined[reason] += 1

    def _keep_missed(self, t: torch.Tensor) -> Saved:
        """A save after a guard miss, with no op tracker running: kept as it is, exact, and
        counted in its module's row."""
        if self.in_scope is not None and not self.in_scope():
            return Saved(Entry(t.detach(), None, _OUTSIDE, t._version, None))
        if is_parameter(t, self._state(), ()):
            self.tally.param_refs += 1
            return Saved(Entry(t.detach(), None, _PARAMETER, t._version, None))
        site = self._site(t)
        row = self.tally.row(site)
        row.saved += 1
        row.ops["?"] += 1
        entry = self._store(t, site, row, None, MISSED_REASON)
        self._counted_before_miss(t, entry)
        self._count(t, entry, row)
        graph = self._tls.graph
        if graph is not None:
            entry.graph = graph
            graph.entries.append(weakref.ref(entry))
        entry.pending += 1
        return Saved(entry)

    def _counted_before_miss(self, t: torch.Tensor, entry: Entry) -> None:
        """A save after a miss over the storage of a replayed save before it (the next
        layer's input, an activation's output): the trace counted that storage in stock's
        bytes, and in the stored bytes where its entry keeps the tensor; claimed for
        ``entry`` here, :meth:`_count` adds it once, as the full path would."""
        tls = self._tls
        if not t.numel():
            return
        j = tls.bases.bases.get(storage_base(t), -1)
        if not 0 <= j < tls.counted:
            return
        tally = self.tally
        coded = tls.bases.coded.get(j)
        if coded is None:  # kept as it is: stock's bytes and ours
            tally.raw_storages.count(t, entry)
            tally.stored_storages.count(t, entry)
        elif coded() is not None:  # a code of the same storage: stock's bytes only
            tally.raw_storages.count(t, entry)

    def _count(self, t: torch.Tensor, entry: Entry, row: Row) -> None:
        """Count a new entry: ``t``'s storage in stock's bytes, whole and once (a view or
        alias of a storage a live entry counted adds nothing: stock holds it once), and in the
        stored bytes each storage its value holds (a payload's at its full size)."""
        tally = self.tally
        row.raw_bytes += tally.raw_storages.count(t, entry)
        value = entry.value
        if isinstance(value, torch.Tensor | Packed):
            tally.keep(row, value, entry)
        elif isinstance(value, Recomputed):  # a mask or scale its recipe holds alive
            for held in value.recipe.held():
                if storage_base(held) not in self._skip:
                    tally.keep(row, held, entry)
        if entry.watch is not None:
            tally.keep_alias(row, entry.watch)
        if isinstance(value, Packed) and t.device.type != "cpu":
            row.host_bytes += value.nbytes("cpu")

    def _store_as_is(self, entry: Entry, t: torch.Tensor) -> None:
        """Turn a compressed entry into the tensor itself, which a later op saves as is.

        Autograd keeps that tensor alive for the later op anyway; holding the earlier op's
        code beside it would cost more than stock (a ReLU's 1-bit mask next to the conv input
        it also is), so the earlier op reads the exact tensor instead: less memory, no loss.
        """
        packed = entry.value
        if isinstance(packed, Recomputed):  # it held no bytes: now the tensor's
            row = self.tally.row(entry.site)
            self.tally.keep(row, t, entry)
            row.derived -= 1
            value = t.detach()
            entry.value = value if value.shape == packed.shape else value.view(packed.shape)
            entry.compressor = None
            entry.variant = ""
            return
        if not isinstance(packed, Packed):
            return
        row = self.tally.row(entry.site)
        self.tally.drop(row, packed, entry)
        self.tally.keep(row, t, entry)
        if t.device.type != "cpu":
            row.host_bytes -= packed.nbytes("cpu")
        row.compressed -= 1
        value = t.detach()
        entry.value = value if value.shape == packed.shape else value.view(packed.shape)
        entry.compressor = None
        entry.variant = ""

    def _remember(self, key: tuple[Any, ...], entry: Entry) -> None:
        """Index a stored entry for deduplication (weakly: the graph owns the entry)."""
        live = self._live
        live[key] = weakref.ref(entry)
        if len(live) > self._live_limit:
            for k in [k for k, r in live.items() if r() is None]:
                del live[k]
            self._live_limit = max(1024, 2 * len(live))

    def _choose(self, t: torch.Tensor, site: Site, nbytes: int) -> tuple[Compressor | None, str]:
        """The compressor that will take ``t``, or None and why not."""
        if nbytes < self.min_bytes:
            return None, f"smaller than min_bytes={self.min_bytes}"
        compressor = self.resolve(site, self._types(site))
        if compressor is None:
            return None, ""
        if not site.op and not t.requires_grad and not compressor.lossless:
            return None, CONSTANT_REASON
        if site.op == SDPA and not compressor.lossless:
            call = site.opcall
            if save_kind(SDPA, site.role, t, call.args) != "source":
                return None, FUSED_OUTPUT_REASON
            if not may_replay_attention(t.device, call.args, dict(call.kwargs)):
                return None, FUSED_EXACT_REASON
        reasons = compressor.unsupported(t, site)
        if reasons:
            return None, "; ".join(reasons)
        return compressor, ""

    def _store(
        self,
        t: torch.Tensor,
        site: Site,
        row: Row,
        compressor: Compressor | None,
        reason: str,
    ) -> Entry:
        """Store ``t`` (its bytes are counted by :meth:`_count`)."""
        value: torch.Tensor | Packed = t.detach()
        if compressor is not None:
            out = self._compress(compressor, t, site)
            if isinstance(out, Packed):
                value = out
                row.compressed += 1
            else:
                reason = f"{compressor.name} declined it"
                compressor = None
        if reason:
            row.declined[reason] += 1
        entry = Entry(
            value,
            compressor,
            site,
            t._version,
            t if self.dedupe else None,
            watched=t if isinstance(value, Packed) else None,
        )
        entry.reason = reason
        return entry

    def unpack(self, saved: Saved) -> torch.Tensor:
        value = self._restore(saved.entry)
        return value if saved.shape is None else value.reshape(saved.shape)

    def _restore(self, entry: Entry) -> torch.Tensor:
        value = entry.value
        if value is RELEASED:
            raise messages.released_error(entry.site)
        version = entry.modified()
        if version is not None:
            self._release(entry)
            shape = tuple(value.shape)
            raise messages.modified_error(entry.site, shape, version, entry.version)
        if isinstance(value, Recomputed):
            out = entry.cache
            if out is None:
                operands = [self._restore(e).reshape(shape) for e, shape in value.sources]
                try:
                    out = value.recipe(*operands).reshape(value.shape)
                except RuntimeError as e:
                    e.add_note(messages.recompute_note(entry.site, value.shape))
                    raise
                out = with_layout(out, entry.strides)
            entry.pending -= 1
            entry.cache = out if entry.pending > 0 else None
            return out
        if isinstance(value, torch.Tensor):
            return value
        out = entry.cache
        if out is not None:  # decoded for an earlier restore (see below)
            entry.pending -= 1
            if entry.pending <= 0:
                entry.cache = None
            return out
        compressor = entry.compressor
        assert compressor is not None
        try:
            out = with_layout(compressor.decompress(value), entry.strides)
        except KEEP_TYPE as e:
            gone = self._release(entry)
            e.add_note(messages.restore_note(self.names, compressor, entry.site, value, gone))
            raise
        except Exception as e:
            gone = self._release(entry)
            raise messages.restore_error(self.names, compressor, entry.site, value, gone, e) from e
        if entry.pending > 1:
            # Restored again soon (a BatchNorm's input: by the recipe of the output the next
            # conv saves, then by the BatchNorm's own backward, one op apart): decoded once,
            # held until the last restore, as a recomputed value is.
            entry.pending -= 1
            entry.cache = out
        return out

    # -- faults -------------------------------------------------------------------------------

    def _release(self, entry: Entry) -> str:
        """Release what the failing entry's forward pass stored; says what went back."""
        graph = entry.graph
        count, nbytes = graph.release() if graph is not None else (0, 0)
        return messages.released(count, nbytes)
