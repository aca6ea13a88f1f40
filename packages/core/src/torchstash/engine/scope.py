"""Scoping and site naming: which module and op call is running when autograd saves a tensor.

Each module call pushes a frame (told by the module's call entry, :mod:`torchstash.modulecalls`;
the outermost one activates the engine: its saved-tensor hooks and the op tracker); the pack hook names the save's :class:`Site` from the
innermost frame and the running op call.
"""

from __future__ import annotations

import contextlib
import functools
import threading
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
from .entries import Entry, Graph
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
        #: a replayed save missed its guard: the rest of this forward is kept as is
        self.missed = False
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


class Scoping:
    """The engine's scoping and site naming (a part of :class:`~.core.Engine`)."""

    _tls: ThreadState
    _skip: set[int]
    _skip_ptrs: Callable[[], set[int]] | None
    _tally: Tally
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

    def _activation(self) -> Closer:
        """Enter the hooks and the op tracker; the returned closer exits them. An outermost
        activation either records (the full path, op tracker on) or replays a recorded
        trace (hooks only: :mod:`.replay`, and a :class:`Replaying` closer, which runs at
        every step's start and end when the interpreter's caches are cold from the model's
        kernels: every line there costs microseconds)."""
        tls = self._tls
        outermost = tls.active == 0
        if outermost:
            tls.calls.clear()
            tls.op_counts.clear()
            tls.graph = Graph()
            tls.missed = False
            self.replayer.bind(self.tally, self._state, self._replay_code)
            trace = self.replayer.trace
            if trace is not None and not trace.may_replay():
                self.replayer.forget()  # a code's widths change now: the full path, recorded
                trace = None
            tls.replaying = trace
            recording = trace is None and self.replayer.wants_recording()
            tls.recorder = Recorder.start(self.tally) if recording else None
            if trace is not None:
                tls.position = 0
                tls.bases = FirstSaves()
                tls.entries = {}
                tls.keys = {}
                tls.nodes = {}
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

    def _deactivate(self) -> None:
        tls = self._tls
        tls.active -= 1
        OP_STATE.engines -= 1
        if tls.active:
            return
        if tls.replaying is not None:
            self.replayer.finish_replay(tls)
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

    def enter_module(self, info: ModuleInfo, owner: object) -> None:
        """Called before a module's forward: activates the engine if this is the outermost call."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        tls = self._tls
        if tls.graphed:
            return
        if not tls.active and recomputing():
            return
        exit_stack = None if tls.active else self._activation()
        if exit_stack is not None:
            exit_stack.__enter__()
        calls, key = tls.calls, id(owner)
        call = calls.get(key, 0)
        calls[key] = call + 1
        frame = Frame(info, call, owner, exit_stack)
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
        frames = self._tls.frames
        if frames and frames[-1].owner is owner and frames[-1].exit is None:
            frames.pop()  # the usual case: the innermost frame, not the outermost
            return
        for i in range(len(frames) - 1, -1, -1):
            if frames[i].owner is owner:
                popped = frames[i:]
                del frames[i:]
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
