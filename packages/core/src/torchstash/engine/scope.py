"""Scoping and site naming: which module and op call is running when autograd saves a tensor.

Each module call pushes a frame (told by the module's call entry, :mod:`torchstash.modulecalls`;
the outermost one activates the engine: its saved-tensor hooks and the op tracker); the pack hook names the save's :class:`Site` from the
innermost frame and the running op call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..opnames import CARRY_OPS
from ..optrack import STATE as OP_STATE
from ..optrack import OpTracker, role_of, wait_for, watching
from ..packed import storage_base
from ..site import NO_CALL, OpCall, Site
from . import attention
from .entries import Entry, Graph
from .hookless import Cursor, Hookless, first_shape, no_hooks_on, root_key
from .regions import Region
from .replay import FirstSaves, Recorder, Replayer, Trace
from .tally import Tally

if TYPE_CHECKING:
    from .entries import Saved
    from .recompute import Derivation


@dataclass(frozen=True)
class ModuleInfo:
    qualname: str
    tag: str
    type_name: str
    index: int
    type_names: frozenset[str]

    def site(self, **fields: Any) -> Site:
        """A site in this module (``fields``: the rest of the site: its op, role...)."""
        return Site(
            module=self.qualname,
            tag=self.tag,
            module_type=self.type_name,
            module_index=self.index,
            **fields,
        )


NO_MODULE = ModuleInfo("", "", "", -1, frozenset())

#: the root module's call: the module, its positional and keyword arguments
Root = tuple[object, tuple[Any, ...], "dict[str, Any] | None"]


def recomputing() -> bool:
    """A forward run by a backward: a checkpoint recomputing its block. What a non-reentrant
    checkpoint's recomputation saves belongs to its own saved-tensor hook, which matches it
    against the first forward's saves: the engine must not take it over. A reentrant one's
    is freed by the block's own backward, which runs next: coding it would cost a kernel each
    way and keep nothing for longer (``checkpoint+quant.int8`` took 1.9x a step for it)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


class Closer(Protocol):
    """What an activation or a replayed region returns: ``close()`` leaves it (and it is a
    context manager too)."""

    def close(self) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any, /
    ) -> Any: ...


class Replaying:
    """An outermost activation that replays a trace: the saved-tensor hooks alone, pushed
    here and popped by :meth:`close` before the engine counts the forward (what an
    :class:`~contextlib.ExitStack` would do, in fewer steps)."""

    __slots__ = ("engine", "hooks")

    def __init__(self, engine: Scoping) -> None:
        self.engine = engine
        self.hooks: torch.autograd.graph.saved_tensors_hooks | None = (
            torch.autograd.graph.saved_tensors_hooks(engine.pack, engine.unpack)
        )

    def __enter__(self) -> Replaying:
        assert self.hooks is not None
        self.hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any, /
    ) -> None:
        self.close()

    def close(self) -> None:
        hooks, self.hooks = self.hooks, None
        if hooks is None:
            return  # closed already
        try:
            hooks.__exit__(None, None, None)
        finally:
            self.engine._deactivate()


@dataclass(slots=True, eq=False)
class Frame:
    info: ModuleInfo
    call: int
    owner: object
    exit: Closer | None = None
    #: while recording: the forward's op counts when the call began (a region's, replayed)
    counts: dict[str, int] | None = None
    #: while recording: the call's position among the forward's module calls
    position: int = -1


class ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: list[Frame] = []
        self.active = 0  # activations of this engine on this thread
        self.calls: Counter[int] = Counter()
        self.op_counts: Counter[str] = Counter()
        self.last_call = -1
        self.ordinal = 0
        self.graph: Graph | None = None  # the forward pass now storing
        #: the derive op call whose saves are being collected
        self.deriving: Derivation | None = None
        #: the forward being recorded (:mod:`.replay`), or None
        self.recorder: Recorder | None = None
        #: the trace this forward replays, or None; where it is at; the storages its saves
        #: met (address -> first position); by position, the entries a later save shares
        #: and their dedupe keys
        self.replaying: Trace | None = None
        self.position = 0
        self.bases = FirstSaves()
        self.entries: dict[int, Entry] = {}
        self.keys: dict[int, tuple[Any, ...]] = {}
        #: by position, the autograd nodes of the operands later recomputed saves read
        self.nodes: dict[int, Any] = {}
        #: a replayed save missed its guard: the rest of this forward is kept as is; the
        #: saves before the miss, which the trace counted
        self.missed = False
        self.counted = 0
        #: parameters' and buffers' addresses (None: not read yet this forward)
        self.skip: set[int] | None = None
        #: the region being replayed down the full path (:mod:`.regions`), and the tally
        #: its saves count in meanwhile (the trace's totals count them)
        self.region: Frame | None = None
        self.scratch: Tally | None = None
        #: the full path's last save shared an earlier entry
        self.shared = False
        #: calls of a compiled model running (their graphs save through graph hooks:
        #: :mod:`torchstash.graphhooks`): the engine stays out of them
        self.graphed = 0
        #: where a hookless forward is in its trace (:mod:`.hookless`), or None
        self.lean: Cursor | None = None
        #: the fused attention call a replayed forward is in (:mod:`.attention`)
        self.attention = attention.Call()


class Scoping:
    """The engine's scoping and site naming (a part of :class:`~.core.Engine`)."""

    _tls: ThreadState
    _skip: set[int]
    _skip_ptrs: Callable[[], set[int]] | None
    _tally: Tally
    _state_key: Callable[[], Any] | None
    _hookless: bool
    dedupe: bool
    replayer: Replayer

    @property
    def tally(self) -> Tally:
        """The engine's accounting (inside a replayed region, a scratch one: the trace's
        totals count the region's saves)."""
        scratch = self._tls.scratch
        return self._tally if scratch is None else scratch

    if TYPE_CHECKING:

        def _replay_code(self, t: torch.Tensor, move: Any) -> Any: ...
        def _unattend(self, tls: ThreadState) -> None: ...
        def pack(self, t: torch.Tensor) -> Saved: ...
        def unpack(self, saved: Saved) -> torch.Tensor: ...
        def _carry_recipe(
            self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], result: Any
        ) -> None: ...

    @property
    def active(self) -> bool:
        return self._tls.active > 0

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        with self._activation():
            yield

    def _activation(self, root: Root | None = None) -> Closer:
        """Enter the hooks and the op tracker; the returned closer exits them. An outermost
        activation either records (the full path, op tracker on) or replays a recorded
        trace (hooks only: :mod:`.replay`, and a :class:`Replaying` closer, which runs at
        every step's start and end when the interpreter's caches are cold from the model's
        kernels: every line there costs microseconds), or with ``root`` (the root module's
        call) and a lean trace, no hook at all (:mod:`.hookless`)."""
        tls = self._tls
        outermost = tls.active == 0
        if outermost:
            if root is not None and self._hookless and self._go_hookless(tls, root):
                tls.active += 1
                OP_STATE.engines += 1
                return Hookless(self._deactivate)
            tls.calls.clear()
            tls.op_counts.clear()
            tls.graph = Graph()
            tls.missed = False
            tls.counted = 0
            self.replayer.bind(self.tally, self._state, self._replay_code)
            trace = self.replayer.trace
            if trace is not None and not trace.may_replay():
                self.replayer.forget()  # a code's widths change now: the full path, recorded
                trace = None
            tls.replaying = trace
            recording = trace is None and self.replayer.wants_recording()
            tls.recorder = Recorder.start(self.tally) if recording else None
            if tls.recorder is not None and root is not None and self._hookless:
                tls.recorder.root = root_key(root[1], root[2], self._state_key)
            if trace is not None:
                tls.position = 0
                tls.bases = FirstSaves()
                tls.entries = {}
                tls.keys = {}
                tls.nodes = {}
                tls.attention = attention.Call()
            # a model's parameters and buffers: read now for the full path, when first
            # needed for a replayed one; a stash block's modules add theirs as they run
            if self._skip_ptrs is None:
                self._skip = set()
            elif trace is None:
                self._skip = self._skip_ptrs()
            tls.skip = None if self._skip_ptrs is not None and trace is not None else self._skip
        replaying = tls.replaying is not None
        if outermost and replaying:
            tls.active += 1
            OP_STATE.engines += 1
            return Replaying(self)
        stack = contextlib.ExitStack()
        if outermost and self.dedupe and not replaying:
            stack.enter_context(watching(CARRY_OPS, self._carry_recipe))
        tls.active += 1
        OP_STATE.engines += 1
        stack.callback(self._deactivate)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
        if not replaying:
            enter_tracker(stack)
        return stack

    def _go_hookless(self, tls: ThreadState, root: Root) -> bool:
        """Whether this forward runs with no hook (:mod:`.hookless`): its root call the
        recorded one and the replayer agreeing; if so it is set up to."""
        replayer = self.replayer
        trace = replayer.trace
        owner, args, kwargs = root
        if trace is None or not trace.lean or not trace.calls:
            return False
        ref, training, shape, _ = trace.calls[0]
        if ref() is not owner or owner.training != training or first_shape(args) != shape:
            return False
        if not no_hooks_on():  # another's hooks would take the saves
            return False
        if not replayer.goes_hookless(trace, lambda: root_key(args, kwargs, self._state_key)):
            return False
        replayer.bind(self.tally, self._state, self._replay_code)
        tls.calls.clear()
        tls.graph = Graph() if trace.islands else None
        tls.missed = False
        tls.counted = 0
        tls.bases = FirstSaves()
        tls.replaying = None
        tls.recorder = None
        tls.lean = Cursor(trace, trace.calls)
        tls.skip = None
        return True

    def _leave_hookless(self, tls: ThreadState) -> None:
        """A hookless forward's module call is not the recorded one (a guard miss): the
        saves so far count as the trace says, and the rest of the forward is the full path's
        after a miss (:meth:`_unlean`)."""
        cursor = tls.lean
        assert cursor is not None
        trace, calls, i = cursor.trace, cursor.calls, cursor.position
        tls.counted = calls[i][3] if i < len(calls) else len(trace.moves)
        self.replayer.count_prefix(trace, tls.counted)
        self.replayer.miss()
        self._unlean(tls)

    def _unlean(self, tls: ThreadState, hooks: Any = None) -> None:
        """A hookless forward left its trace (counted up to there): the module calls running
        get their frames, and the engine's hooks (``hooks``: an island's, on already) keep and
        count the rest of the forward as it goes (when another's are on, that part is left
        to them, and not counted)."""
        cursor = tls.lean
        assert cursor is not None
        calls, i = cursor.calls, cursor.position
        tls.lean = None
        tls.missed = True
        made = [c[0]() for c in calls[:i]]
        tls.calls.clear()
        for m in made:
            tls.calls[id(m)] += 1
        running = [
            Frame(info, sum(1 for m in made[:position] if m is owner), owner)
            for info, owner, position in cursor.stack
        ]
        tls.frames[1:1] = running  # between the root's and an island's
        root = tls.frames[0].exit if tls.frames else None
        if isinstance(root, Hookless):
            if hooks is not None:
                root.hooks = hooks  # taken off when the forward ends
            else:
                root.hook(self.pack, self.unpack)

    def _enter_island(
        self, tls: ThreadState, cursor: Cursor, info: ModuleInfo, owner: object, at: int
    ) -> None:
        """A hookless forward enters a module call that runs with the hooks on: its saves
        replayed behind their guards from the move the call starts at."""
        start, end, number = cursor.islands[at]
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        cursor.island = (owner, end, hooks)
        tls.replaying = cursor.trace
        tls.position = start
        tls.bases = FirstSaves()
        tls.entries = {}
        tls.keys = {}
        tls.nodes = {}
        tls.frames.append(Frame(info, number, owner))

    def _leave_island(self, tls: ThreadState, cursor: Cursor) -> None:
        """The module call with the hooks on returned: hookless again if it made every save
        it recorded, else a miss (counted up to there)."""
        island = cursor.island
        assert island is not None
        cursor.island = None
        _, end, hooks = island
        tls.frames.pop()
        done = tls.position
        tls.replaying = None
        tls.entries = {}
        tls.keys = {}
        tls.nodes = {}
        if done == end:
            hooks.__exit__(None, None, None)
            return
        tls.counted = min(done, end)
        self.replayer.count_prefix(cursor.trace, tls.counted)
        self.replayer.miss()
        self._unlean(tls, hooks)

    def _returned(self, tls: ThreadState, frame: Frame) -> None:
        """A recorded module call returned: the moves and calls made by then."""
        rec = tls.recorder
        if rec is not None:
            rec.ends[frame.position] = (len(rec.moves), len(rec.calls))

    def _deactivate(self) -> None:
        tls = self._tls
        tls.active -= 1
        OP_STATE.engines -= 1
        if tls.active:
            return
        if tls.lean is not None:
            cursor, tls.lean = tls.lean, None
            trace, i = cursor.trace, cursor.position
            if cursor.island is not None:  # left by the root's exit: saves unknown
                cursor.island[2].__exit__(None, None, None)
                tls.replaying = None
                self.replayer.count_prefix(trace, min(tls.position, cursor.island[1]))
                self.replayer.miss()
            elif i == len(cursor.calls):
                self.replayer.count_whole(trace)
                self.replayer.hookless += 1
            else:  # module calls the recording made did not run
                self.replayer.count_prefix(trace, cursor.calls[i][3])
                self.replayer.miss()
        elif tls.replaying is not None:
            self.replayer.finish_replay(tls)
            self._unattend(tls)  # a fused attention's codes no checked call read
            tls.replaying = None
            tls.entries = {}
            tls.keys = {}
            tls.nodes = {}
            tls.bases = FirstSaves()
        elif tls.recorder is not None:
            recorder, tls.recorder = tls.recorder, None
            if not tls.missed:
                self.replayer.finish_recording(recorder)

    def _state(self) -> set[int]:
        """The parameters' and buffers' addresses, read once a forward (a replayed forward
        reads them only when a save needs them)."""
        tls = self._tls
        if tls.skip is None:
            self._skip = self._skip_ptrs() if self._skip_ptrs else set()
            tls.skip = self._skip
        return tls.skip

    @contextlib.contextmanager
    def in_graph(self) -> Iterator[None]:
        """A compiled call of the model runs: its graphs save through the strategy's graph
        hooks, and the engine's module hooks (run eagerly around the graph) do nothing."""
        tls = self._tls
        tls.graphed += 1
        try:
            yield
        finally:
            tls.graphed -= 1

    def enter_module(
        self,
        info: ModuleInfo,
        owner: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Called before a module's forward (``args`` and ``kwargs``: its call's): activates
        the engine if this is the outermost call."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        tls = self._tls
        cursor = tls.lean
        if cursor is not None:  # a hookless forward: its call guard only
            i = cursor.position
            expected = cursor.calls
            if i < len(expected):
                ref, training, shape, _ = expected[i]
                first = args[0] if args else None  # first_shape(args), inline: every call
                if (
                    ref() is owner
                    and owner.training is training
                    and (first.shape if isinstance(first, torch.Tensor) else None) == shape
                ):
                    if i not in cursor.islands:
                        cursor.position = i + 1
                        cursor.stack.append((info, owner, i))
                        return
                    if no_hooks_on():
                        cursor.position = i + 1
                        self._enter_island(tls, cursor, info, owner, i)
                        return
            self._leave_hookless(tls)
        if tls.graphed:
            return
        if not tls.active and recomputing():
            return
        exit_stack = None if tls.active else self._activation((owner, args, kwargs))
        if exit_stack is not None:
            exit_stack.__enter__()
        calls, key = tls.calls, id(owner)
        call = calls.get(key, 0)
        calls[key] = call + 1
        frame = Frame(info, call, owner, exit_stack)
        rec = tls.recorder
        if rec is not None and not tls.missed:
            frame.position = len(rec.calls)
            rec.calls.append(
                (
                    weakref.ref(owner),
                    bool(getattr(owner, "training", True)),
                    first_shape(args),
                    len(rec.moves),
                )
            )
        if exit_stack is None:
            if tls.recorder is not None:
                frame.counts = dict(tls.op_counts)
            elif tls.replaying is not None and tls.region is None and tls.replaying.regions:
                region = tls.replaying.regions.get((key, call))
                if region is not None and region.owner() is owner and not tls.missed:
                    frame.exit = self._enter_region(frame, region)
        tls.frames.append(frame)

    def _enter_region(self, frame: Frame, region: Region) -> contextlib.ExitStack:
        """Run a replayed forward's region down the full path: the op tracker on for this
        module call, its op counts as recorded, its counts in a scratch tally."""
        tls = self._tls
        stack = contextlib.ExitStack()
        tls.region = frame
        tls.op_counts = Counter(region.counts)
        tls.scratch = Tally()
        self._state()  # the parameters, for the full path
        stack.callback(self._leave_region)
        if self.dedupe:
            stack.enter_context(watching(CARRY_OPS, self._carry_recipe))
        enter_tracker(stack)
        return stack

    def _leave_region(self) -> None:
        tls = self._tls
        tls.region = None
        tls.scratch = None

    def exit_module(self, owner: object) -> None:
        """Called after a module's forward (also when it raised): pops its frame and above."""
        tls = self._tls
        cursor = tls.lean
        if cursor is not None:
            stack = cursor.stack
            if stack and stack[-1][1] is owner:  # a hookless forward's module call
                stack.pop()
                return
            island = cursor.island
            if island is not None and island[0] is owner:
                self._leave_island(tls, cursor)
                return
        frames = tls.frames
        if frames and frames[-1].owner is owner and frames[-1].exit is None:
            frame = frames.pop()  # the usual case: the innermost frame, not the outermost
            if frame.position >= 0:
                self._returned(tls, frame)
            return
        for i in range(len(frames) - 1, -1, -1):
            if frames[i].owner is owner:
                popped = frames[i:]
                del frames[i:]
                for f in popped:
                    if f.position >= 0:
                        self._returned(tls, f)
                for f in reversed(popped):
                    if f.exit is not None:
                        f.exit.close()
                return

    def _site(self, t: torch.Tensor) -> Site:
        tls = self._tls
        frame = tls.frames[-1] if tls.frames else None
        info = frame.info if frame else NO_MODULE
        op, func = OP_STATE.op, OP_STATE.raw
        op_index, ordinal = self._op_position(tls)
        return info.site(
            op=op,
            func=func,
            op_index=op_index,
            role=role_of(t) if op else "",
            ordinal=ordinal,
            call=frame.call if frame else 0,
            training=bool(getattr(frame.owner, "training", True)) if frame else True,
            opcall=op_call() if op else NO_CALL,
        )

    @staticmethod
    def _op_position(tls: ThreadState) -> tuple[int, int]:
        """The running op call's index among the forward's calls of its op, and this save's
        ordinal among the call's saves (-1 and the ordinal outside a tracked call)."""
        op = OP_STATE.op
        if tls.last_call != OP_STATE.call_id:  # the first tensor this op call saves
            tls.last_call = OP_STATE.call_id
            tls.ordinal = 0
            if op:
                tls.op_counts[op] += 1
        else:
            tls.ordinal += 1
        return (tls.op_counts[op] - 1 if op else -1), tls.ordinal

    def skip_module_state(self, module: torch.nn.Module) -> None:
        """Never compress ``module``'s own parameters and buffers (or views of them)."""
        for p in module.parameters(recurse=False):
            self._skip.add(storage_base(p))
        for b in module.buffers(recurse=False):
            self._skip.add(storage_base(b))

    def _types(self, site: Site) -> frozenset[str]:
        frames = self._tls.frames
        return frames[-1].info.type_names if frames else frozenset()


def op_call() -> OpCall:
    """The running op's call, for the site of what it saves."""
    state = OP_STATE
    return OpCall(tuple(state.args), state.kwargs, functools.partial(wait_for, state.call_id))


def enter_tracker(stack: contextlib.ExitStack) -> None:
    """The op tracker on until ``stack`` closes, unless one is on already on this thread."""
    if OP_STATE.depth == 0:
        stack.enter_context(OpTracker())
        OP_STATE.depth += 1
        stack.callback(leave_tracker)


def leave_tracker() -> None:
    OP_STATE.depth -= 1
