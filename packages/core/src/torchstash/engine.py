"""The engine: saved-tensor hooks that compress what autograd saves, with exact accounting.

One :class:`Engine` serves one ``apply`` handle or one ``stash`` block. Its pack hook names the
tensor's :class:`Site` (innermost module, op, role), skips what must stay as is (parameters,
buffers, integer and bool tensors, small tensors), stores a tensor saved by several ops once,
asks the policy for a compressor, and counts raw and stored bytes per module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .compressor import Compressor
from .derive import (
    CARRY_OPS,
    DERIVE_OPS,
    FUSED,
    SDPA,
    Recipe,
    attention_operand,
    fused_attention,
    matmul_order,
    may_replay_attention,
    recipe,
    replay_step,
    save_kind,
)
from .errors import CompressionError, KernelUnavailable
from .optrack import STATE as OP_STATE
from .optrack import OpTracker, on_result, role_of, wait_for, watching
from .packed import Packed, StorageLedger, raw_nbytes, storage_base
from .site import NO_CALL, OpCall, Site

Resolver = Callable[[Site, frozenset[str]], "Compressor | None"]
#: a recipe's operands: each entry (held weakly) and the shape its op saved it in
_Sources = tuple[tuple["weakref.ref[_Entry]", torch.Size], ...]

#: Tensors smaller than this are stored as they are: compressing them saves nothing worth a kernel.
DEFAULT_MIN_BYTES = 1024

#: Ops autocast runs in a lower precision, whose saved first operand may be its cast.
AUTOCAST_CASTING_OPS = frozenset({"linear", "matmul", "conv"})

#: Why a tensor that needs no gradient, saved where no op is seen (an autograd Function's
#: ``save_for_backward``: a reentrant checkpoint's block inputs), is kept exact by lossy
#: strategies: such constants are masks (0 and the dtype's minimum, which no group code holds)
#: and rotary tables, shared by every block, so stored once anyway.
CONSTANT_REASON = (
    "a constant (no gradient) saved by an autograd Function: kept exact, as an attention "
    "mask or a rotary table must be"
)

#: Why a fused attention's output, log-sum-exp or mask is not coded by a lossy strategy.
FUSED_OUTPUT_REASON = (
    "a fused attention's output, log-sum-exp and mask are kept exact, or recomputed from its "
    "stored q, k, v in backward where its kernel allows: its backward reads them with q, k "
    "and v, and coded copies disagree with one another"
)
#: Why a fused attention's q, k, v are kept exact after all.
FUSED_EXACT_REASON = (
    "a fused attention whose output the engine cannot recompute (its kernel is not one it "
    "replays, or it drops): its q, k, v are kept exact like its output"
)

#: Errors a compressor raises that keep their type (a note is added): users catch these by type
#: (an out-of-memory back-off, ``TORCHSTASH_KERNELS=require``); anything else is wrapped in a
#: :class:`CompressionError` that names the strategy, the compressor, the module and the tensor.
KEEP_TYPE: tuple[type[BaseException], ...] = (
    torch.OutOfMemoryError,
    MemoryError,
    KernelUnavailable,
)


@dataclass(frozen=True)
class ModuleInfo:
    qualname: str
    tag: str
    type_name: str
    index: int
    type_names: frozenset[str]


_NO_MODULE = ModuleInfo("", "", "", -1, frozenset())
_PARAMETER = Site(role="parameter")
_OUTSIDE = Site(role="outside the stash block")


@dataclass
class Row:
    """Accounting for one module (or the top level)."""

    module: str
    module_type: str
    saved: int = 0  # tensors autograd saved here (dedupe hits included)
    shared: int = 0  # of which were already stored (same tensor saved by another op)
    raw_bytes: int = 0  # bytes as stock PyTorch would hold them (each storage once)
    stored_bytes: int = 0  # bytes actually held (the storages of what is kept, each once)
    host_bytes: int = 0  # of stored_bytes, held in host memory for an accelerator tensor
    compressed: int = 0  # tensors a compressor packed
    derived: int = 0  # tensors kept as a recompute from another op's stored input (no bytes)
    declined: Counter[str] = field(default_factory=Counter)  # reason -> count
    ops: Counter[str] = field(default_factory=Counter)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


def _recomputing() -> bool:
    """In backward under another saved-tensor hook: a non-reentrant checkpoint recomputing its
    forward. What that forward saves belongs to the checkpoint's hook, which matches it against
    the first forward's saves; the engine must not take it over."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if task is None or top is None or task() == -1:
        return False
    return top(False) is not None


class Tally:
    """Per-module accounting, plus the parameters autograd referenced (never counted as raw)."""

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.param_refs = 0
        self._lock = threading.Lock()
        #: the storages counted in raw_bytes and in stored_bytes, each once while held
        self.raw_storages = StorageLedger()
        self.stored_storages = StorageLedger()

    def row(self, site: Site) -> Row:
        r = self.rows.get(site.module)
        if r is None:
            r = self.rows[site.module] = Row(site.module, site.module_type)
        return r

    def reset(self) -> None:
        with self._lock:
            self.rows.clear()
            self.param_refs = 0

    @property
    def raw_bytes(self) -> int:
        return sum(r.raw_bytes for r in self.rows.values())

    @property
    def stored_bytes(self) -> int:
        return sum(r.stored_bytes for r in self.rows.values())


class _Recomputed:
    """An entry's value that is a recipe over other entries (see :mod:`.derive`)."""

    __slots__ = ("recipe", "shape", "sources")

    def __init__(
        self, sources: list[tuple[_Entry, torch.Size]], recipe: Recipe, shape: torch.Size
    ) -> None:
        #: the operands' entries, each with the shape its op saved it in (kept alive as long
        #: as this save is)
        self.sources = sources
        self.recipe = recipe
        self.shape = shape


@dataclass
class _Derivation:
    """The call of a :data:`DERIVE_OPS` op whose saves are being collected: its recipe, and
    for each operand saved, its entry, the shape saved and its role."""

    call_id: int
    recipe: Recipe
    sources: list[tuple[weakref.ref[_Entry], torch.Size, str]] = field(default_factory=list)
    #: False once an operand is stored in a way its output cannot be recomputed from
    derivable: bool = True
    #: what the op saved of its own outputs (a fused attention's output and log-sum-exp)
    outputs: list[tuple[_Entry, torch.Size]] = field(default_factory=list)


class _Entry:
    """One stored tensor, shared by every op that saved it."""

    __slots__ = (
        "__weakref__",
        "cache",
        "compressor",
        "graph",
        "pending",
        "reason",
        "site",
        "source",
        "value",
        "variant",
        "version",
        "watch",
    )

    def __init__(
        self,
        value: torch.Tensor | Packed | _Recomputed,
        compressor: Compressor | None,
        site: Site,
        version: int,
        source: torch.Tensor | None,
        variant: str = "",
        watched: torch.Tensor | None = None,
    ) -> None:
        self.value = value
        self.compressor = compressor
        self.variant = variant
        #: kept without its op call: the call's arguments must not outlive the call
        self.site = site if site.opcall is NO_CALL else dataclasses.replace(site, opcall=NO_CALL)
        self.version = version
        self.source: Callable[[], torch.Tensor | None] = (
            weakref.ref(source) if source is not None else lambda: None
        )
        #: the forward pass that stored it (None when shared with another pass)
        self.graph: _Graph | None = None
        #: an empty tensor sharing the saved tensor's version counter (:func:`_version_alias`),
        #: so an in-place change after the save is seen in backward as stock PyTorch sees it,
        #: without holding the memory a code replaced
        self.watch = _version_alias(watched) if watched is not None else None
        #: restores still to come (saves and recipes that read it): a recomputed value is
        #: kept from its first restore until the last (an attention map is read by the
        #: softmax's backward, the matmul's and the recomputed projection input's)
        self.pending = 0
        self.cache: torch.Tensor | None = None
        #: why it is stored as it is (counted in its row's ``declined``), or ""
        self.reason = ""

    def modified(self) -> int | None:
        """The saved tensor's version now, when an in-place op changed it since the save."""
        value = self.value
        watch = value if isinstance(value, torch.Tensor) else self.watch
        if watch is None or watch._version == self.version:
            return None
        return watch._version


#: What a released entry holds: its backward failed, and its memory went back.
_RELEASED = torch.empty(0)


class _Graph:
    """The entries one forward pass stored, held weakly (the autograd graph owns them).

    When an error escapes an unpack hook the backward through that graph cannot finish; the
    entries are released at once, so an out-of-memory back-off gets the memory back even while
    the failed graph (``loss``) is still referenced.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[weakref.ref[_Entry]] = []

    def release(self) -> tuple[int, int]:
        """Drop every entry's payload; returns (tensors, bytes) released."""
        count = nbytes = 0
        for ref in self.entries:
            entry = ref()
            if entry is None or entry.graph is not self or entry.value is _RELEASED:
                continue
            value = entry.value
            if isinstance(value, Packed):
                nbytes += value.nbytes()
            elif isinstance(value, torch.Tensor):
                nbytes += raw_nbytes(value)
            count += 1
            entry.value = _RELEASED
            entry.cache = None
            entry.source = lambda: None  # never shared again
        self.entries.clear()
        return count, nbytes


class _Saved:
    """What the pack hook hands autograd: a reference to a (possibly shared) entry."""

    __slots__ = ("entry", "shape")

    def __init__(self, entry: _Entry, shape: tuple[int, ...] | None = None) -> None:
        self.entry = entry
        #: set when this save is a reshaped view of the entry's tensor (same memory)
        self.shape = shape


@dataclass
class _Frame:
    info: ModuleInfo
    call: int
    owner: object
    exit: contextlib.ExitStack | None = None


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.active = 0  # activations of this engine on this thread
        self.calls: Counter[int] = Counter()
        self.op_counts: Counter[str] = Counter()
        self.last_call = -1
        self.ordinal = 0
        self.graph: _Graph | None = None  # the forward pass now storing
        #: the derive op call whose saves are being collected
        self.deriving: _Derivation | None = None


class Engine:
    def __init__(
        self,
        resolve: Resolver,
        *,
        min_bytes: int = DEFAULT_MIN_BYTES,
        skip_ptrs: Callable[[], set[int]] | None = None,
        dedupe: bool = True,
        in_scope: Callable[[], bool] | None = None,
    ) -> None:
        self.resolve = resolve
        #: whether the running code is the engine's to compress (a ``stash`` block's own
        #: thread and context); None: whatever runs under its hooks
        self.in_scope = in_scope
        self.min_bytes = min_bytes
        self.dedupe = dedupe
        self.tally = Tally()
        self._skip_ptrs = skip_ptrs
        self._skip: set[int] = set()
        self._tls = _ThreadState()
        self._live: dict[tuple[Any, ...], weakref.ref[_Entry]] = {}
        self._live_limit = 1024
        #: outputs a later save may recompute: key -> (the output, its recipe, the operands'
        #: entries with their saved shapes)
        self._recipes: dict[
            tuple[Any, ...], tuple[weakref.ref[torch.Tensor], Recipe, _Sources]
        ] = {}

    # -- scoping ------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._tls.active > 0

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        with self._activation():
            yield

    def _activation(self) -> contextlib.ExitStack:
        """Enter the hooks and the op tracker; the returned stack exits them."""
        stack = contextlib.ExitStack()
        tls = self._tls
        if tls.active == 0:
            tls.calls.clear()
            tls.op_counts.clear()
            tls.graph = _Graph()
            self._skip = self._skip_ptrs() if self._skip_ptrs else set()
        if tls.active == 0 and self.dedupe:
            stack.enter_context(watching(CARRY_OPS, self._carry_recipe))
        tls.active += 1
        stack.callback(self._deactivate)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack))
        if OP_STATE.depth == 0:
            stack.enter_context(OpTracker())
            OP_STATE.depth += 1
            stack.callback(_leave_tracker)
        return stack

    def _deactivate(self) -> None:
        self._tls.active -= 1

    def enter_module(self, info: ModuleInfo, owner: object) -> None:
        """Called before a module's forward: activates the engine if this is the outermost call."""
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            return
        tls = self._tls
        if not tls.active and _recomputing():
            return
        exit_stack = None if tls.active else self._activation()
        if exit_stack is not None:
            exit_stack.__enter__()
        key = id(owner)
        call = tls.calls[key]
        tls.calls[key] += 1
        tls.frames.append(_Frame(info, call, owner, exit=exit_stack))

    def exit_module(self, owner: object) -> None:
        """Called after a module's forward (also when it raised): pops its frame and above."""
        frames = self._tls.frames
        for i in range(len(frames) - 1, -1, -1):
            if frames[i].owner is owner:
                popped = frames[i:]
                del frames[i:]
                for f in reversed(popped):
                    if f.exit is not None:
                        f.exit.close()
                return

    # -- hooks --------------------------------------------------------------------------------

    def _site(self, t: torch.Tensor) -> Site:
        tls = self._tls
        frame = tls.frames[-1] if tls.frames else None
        info = frame.info if frame else _NO_MODULE
        op, func = OP_STATE.op, OP_STATE.raw
        op_index = -1
        if tls.last_call != OP_STATE.call_id:  # the first tensor this op call saves
            tls.last_call = OP_STATE.call_id
            tls.ordinal = 0
            if op:
                tls.op_counts[op] += 1
        else:
            tls.ordinal += 1
        ordinal = tls.ordinal
        if op:
            op_index = tls.op_counts[op] - 1
        return Site(
            module=info.qualname,
            tag=info.tag,
            module_type=info.type_name,
            module_index=info.index,
            op=op,
            func=func,
            op_index=op_index,
            role=role_of(t) if op else "",
            ordinal=ordinal,
            call=frame.call if frame else 0,
            training=bool(getattr(frame.owner, "training", True)) if frame else True,
            opcall=_op_call() if op else NO_CALL,
        )

    def skip_module_state(self, module: torch.nn.Module) -> None:
        """Never compress ``module``'s own parameters and buffers (or views of them)."""
        for p in module.parameters(recurse=False):
            self._skip.add(storage_base(p))
        for b in module.buffers(recurse=False):
            self._skip.add(storage_base(b))

    def pack(self, t: torch.Tensor) -> _Saved:
        if self.in_scope is not None and not self.in_scope():
            # Under this engine's hooks but outside its scope (another asyncio task on the
            # thread of a ``stash`` block): kept as stock keeps it, and not counted.
            return _Saved(_Entry(t.detach(), None, _OUTSIDE, t._version, None))
        base = t._base
        if (
            isinstance(t, torch.nn.Parameter)
            or (t.requires_grad and t.is_leaf)  # a trainable tensor, not an activation
            or (base is not None and base.requires_grad and base.is_leaf)  # a view of one
            or storage_base(t) in self._skip  # a parameter or buffer, or a view of one
            or _parameter_copy(t)  # autocast's bf16 copy of a weight
        ):
            self.tally.param_refs += 1
            return _Saved(_Entry(t.detach(), None, _PARAMETER, t._version, None))
        site = self._site(t)
        row = self.tally.row(site)
        row.saved += 1
        row.ops[site.op or "?"] += 1
        nbytes = raw_nbytes(t)
        compressor, reason = self._choose(t, site, nbytes)
        variant = _variant(compressor, t, site)
        key = None
        if self.dedupe and t.numel() > 0:
            key = _dedupe_key(t)
            ref = self._live.get(key)
            hit = ref() if ref is not None else None
            # Shared only when stored by the same compressor in the same way: an op-specific
            # code (a ReLU's sign mask) must not stand in for the tensor another op saved.
            # A tensor another op already holds as is is shared as is: a compressed copy
            # beside it would only add memory (a ReLU's output that a conv also saves).
            if hit is not None and hit.source() is not None and compressor is None:
                self._store_as_is(hit, t)  # another op needs it as is: one raw copy, shared
            if (
                hit is not None
                and hit.source() is not None
                and (
                    (hit.compressor is compressor and hit.variant == variant)
                    or hit.compressor is None
                )
            ):
                row.shared += 1
                if hit.graph is not self._tls.graph:
                    hit.graph = None  # two passes hold it: a failed backward must not drop it
                self._note_derive_save(t, hit, compressor, site)
                shape = tuple(t.shape)  # the stored value (tensor or Packed) has its shape
                hit.pending += 1
                return _Saved(hit, None if shape == tuple(hit.value.shape) else shape)
        entry = None
        if key is not None and compressor is not None and self._recipes:
            entry = self._recomputed(t, key, compressor, site, row)
        if entry is None:
            entry = self._store(t, site, row, compressor, reason)
            self._note_derive_save(t, entry, compressor, site)
        self._count(t, entry, row)
        entry.variant = variant
        graph = self._tls.graph
        if graph is not None:
            entry.graph = graph
            graph.entries.append(weakref.ref(entry))
        if key is not None:
            self._remember(key, entry)
        entry.pending += 1
        return _Saved(entry)

    # -- outputs recomputed from a stored input (see .derive) ---------------------------------

    def _note_derive_save(
        self, t: torch.Tensor, entry: _Entry, compressor: Compressor | None, site: Site
    ) -> None:
        """Collect what a :data:`DERIVE_OPS` call saves: its operands (a GELU's input, both
        of an ``attn @ v``), and a LayerNorm's statistics. When the call returns, its output
        becomes recomputable (:meth:`_offer_recipe`) if every operand was stored by a
        compressor whose code is fine to recompute from."""
        if not self.dedupe or site.op not in DERIVE_OPS:
            return
        tls, call_id = self._tls, OP_STATE.call_id
        d = tls.deriving
        if d is not None and d.call_id != call_id:
            d = tls.deriving = None  # an earlier call that raised
        kind = save_kind(site.op, site.role, t, OP_STATE.args)
        if kind == "source":
            if d is None:
                rec = recipe(site.op, OP_STATE.args, OP_STATE.kwargs, OP_STATE.raw)
                if rec is None:
                    return
                d = tls.deriving = _Derivation(call_id, rec)
                on_result(functools.partial(self._offer_recipe, d, site.op))
            derivable = getattr(compressor, "derivable", None)
            d.derivable = (
                d.derivable
                and compressor is not None
                and entry.compressor is compressor
                and isinstance(entry.value, (Packed, _Recomputed))
                and derivable is not None
                and bool(derivable(t, site))
            )
            role = site.role
            if site.op == SDPA:  # q, k, v in the call's order (the kernel saves k first)
                role = ("input", "arg1", "arg2")[attention_operand(t, OP_STATE.args) or 0]
            d.sources.append((weakref.ref(entry), t.shape, role))
        elif kind == "output" and d is not None:  # a fused attention's, after q, k, v
            d.outputs.append((entry, t.shape))
        elif kind == "stat" and d is not None:  # saved after its input (mean, rstd)
            if isinstance(entry.value, torch.Tensor) and entry.value is not _RELEASED:
                d.recipe.stats.append(entry.value)
            else:
                d.recipe.usable = False  # a code, not the tensor: no exact statistics

    def _offer_recipe(self, d: _Derivation, op: str, result: Any) -> None:
        """The derive call returned: make its output recomputable from its operands' entries."""
        tls, rec = self._tls, d.recipe
        if tls.deriving is d:
            tls.deriving = None
        if op == SDPA:
            self._settle_fused_attention(d, result)
            return
        if not isinstance(result, torch.Tensor) or result.numel() == 0 or not d.derivable:
            return
        if not rec.usable or len(d.sources) != rec.arity:
            return
        if len(rec.stats) != rec.stats_needed:
            return  # a LayerNorm or BatchNorm needs its statistics, kept exact
        sources = [(ref, shape) for ref, shape, _ in d.sources]
        if op == "matmul":
            order = matmul_order(
                [tuple(shape) for _, shape, _ in d.sources],
                [role for _, _, role in d.sources],
                tuple(result.shape),
            )
            if order is None:
                return
            sources = [sources[i] for i in order]
        rec.dtype, rec.shape = result.dtype, result.shape
        self._add_recipe(result, rec, tuple(sources))

    def _settle_fused_attention(self, d: _Derivation, result: Any) -> None:
        """A fused attention returned. Its backward reads ``q``, ``k``, ``v``, its output and
        its log-sum-exp together (the map from the first two and the third, the row sums
        from the output): codes of some beside exact others disagree, and training diverged
        (an SDPA GPT at 300 steps: int4 +44%, fp8 NaN). So either the output and log-sum-exp
        are recomputed from the stored ``q``, ``k``, ``v`` by the same kernel in backward
        (:data:`~.derive.FUSED_ATTENTION`, no dropout), or every lossy code of the call is
        turned back into its exact tensor."""
        order = {"input": 0, "arg1": 1, "arg2": 2}
        d.sources.sort(key=lambda source: order.get(source[2], 3))
        entries = [ref() for ref, _, _ in d.sources]
        replay = None
        if isinstance(result, torch.Tensor) and result.numel() and d.recipe.usable:
            replay = fused_attention(result, d.recipe)
        shapes = {tuple(shape) for _, shape in d.outputs}
        if (
            replay is not None
            and d.derivable
            and len(entries) == 3
            and all(e is not None and e.value is not _RELEASED for e in entries)
            and [role for _, _, role in d.sources] == ["input", "arg1", "arg2"]
            and len(d.outputs) == 2
            and shapes == {tuple(result.shape), tuple(result.shape[:-1])}
        ):
            sources = [(e, shape) for e, (_, shape, _) in zip(entries, d.sources) if e is not None]
            for entry, shape in d.outputs:
                which = 0 if tuple(shape) == tuple(result.shape) else 1
                rec = Recipe(FUSED, {"replay": replay, "which": which}, arity=3)
                self._recompute_from(entry, sources, rec, shape)
            out = next(e for e, shape in d.outputs if tuple(shape) == tuple(result.shape))
            self._add_recipe(result, Recipe(SDPA, {}), ((weakref.ref(out), result.shape),))
            return
        for coded in [*entries, *(e for e, _ in d.outputs)]:
            if coded is None or not isinstance(coded.value, Packed):
                continue
            if coded.compressor is None or coded.compressor.lossless:
                continue
            exact = coded.source()
            if exact is not None:
                self._store_as_is(coded, exact)
                coded.reason = FUSED_EXACT_REASON
                self.tally.row(coded.site).declined[FUSED_EXACT_REASON] += 1

    def _recompute_from(
        self,
        entry: _Entry,
        sources: list[tuple[_Entry, torch.Size]],
        rec: Recipe,
        shape: torch.Size,
    ) -> None:
        """Turn a stored entry into a recipe over ``sources`` (a fused attention's output
        once the call returned): its bytes are given back, and it no longer counts as
        declined."""
        row = self.tally.row(entry.site)
        value = entry.value
        if isinstance(value, Packed):
            row.compressed -= 1
            for payload in value.payload_tensors():
                row.stored_bytes -= self.tally.stored_storages.release(payload, entry)
        elif isinstance(value, torch.Tensor):
            row.stored_bytes -= self.tally.stored_storages.release(value, entry)
            entry.watch = _version_alias(value)
        if entry.reason:
            row.declined[entry.reason] -= 1
            if row.declined[entry.reason] <= 0:
                del row.declined[entry.reason]
            entry.reason = ""
        compressor = sources[0][0].compressor
        entry.value = _Recomputed(sources, rec, shape)
        entry.compressor = compressor
        if compressor is not None:
            self._derive(
                value if isinstance(value, torch.Tensor) else None,
                sources,
                compressor,
                entry.site,
                row,
            )

    def _derive(
        self,
        t: torch.Tensor | None,
        sources: list[tuple[_Entry, torch.Size]],
        compressor: Compressor,
        site: Site,
        row: Row,
    ) -> None:
        """Count a save recomputed from ``sources``, which it will restore once each, and tell
        the compressor that stored them (``derived``: its budget counts it)."""
        for source, _ in sources:
            source.pending += 1
        row.derived += 1
        told = getattr(compressor, "derived", None)
        if told is not None and t is not None:
            told(t, site, [source.site for source, _ in sources])

    def _add_recipe(self, result: torch.Tensor, rec: Recipe, sources: _Sources) -> None:
        key = _dedupe_key(result)
        recipes = self._recipes

        def forget(ref: weakref.ref[torch.Tensor]) -> None:
            # The output is gone, so no later save can match it: drop the recipe (and the
            # statistics it holds) now, not when the table next grows.
            found = recipes.get(key)
            if found is not None and found[0] is ref:
                del recipes[key]

        recipes[key] = (weakref.ref(result, forget), rec, sources)

    def _carry_recipe(
        self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], result: Any
    ) -> None:
        """A layout or elementwise op (:data:`~.derive.CARRY_OPS`) on a recomputable tensor:
        its result is recomputable too, by the same recipe one step longer (``attn @ v``,
        transposed and copied into the projection's input; a BatchNorm's output through an
        in-place ReLU; ``q @ k.T`` scaled and masked)."""
        if not self._recipes or not args or not isinstance(result, torch.Tensor):
            return
        carried = self._carried(func, args, kwargs, result)
        if carried is not None:
            self._add_recipe(result, *carried)

    def _carried(
        self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any], result: torch.Tensor
    ) -> tuple[Recipe, _Sources] | None:
        """The recipe of ``result``, one step longer than that of the argument it was computed
        from (the one tensor argument of its size with a recipe), or None."""
        if result.numel() == 0:
            return None
        hits = ((i, self._recipe_before(x, result)) for i, x in enumerate(args))
        index, found = next(((i, f) for i, f in hits if f is not None), (0, None))
        if found is None:
            return None
        same = self._recipes.get(_dedupe_key(result))
        if same is not None and same[0]() is not None:
            # A view of the same values in the same layout (a fused attention's output,
            # transposed back to contiguous, then reshaped): already recomputable. Held by
            # this newer view now, so the recipe outlives the temporary one before it.
            return same[1], same[2]
        step = replay_step(func, args, kwargs, index)
        return None if step is None else (found[1].then(step), found[2])

    def _recipe_before(
        self, x: object, result: torch.Tensor
    ) -> tuple[weakref.ref[torch.Tensor], Recipe, _Sources] | None:
        """The recipe of argument ``x`` of the call that made ``result``, if it has one."""
        if not isinstance(x, torch.Tensor) or x.numel() != result.numel():
            return None
        before = _dedupe_key(x)
        if result is x:  # in place (a ReLU's): x as it was is one version back
            before = (*before[:-1], before[-1] - 1)
        found = self._recipes.get(before)
        return found if found is not None and found[0]() is not None else None

    def _recomputed(
        self,
        t: torch.Tensor,
        key: tuple[Any, ...],
        compressor: Compressor,
        site: Site,
        row: Row,
    ) -> _Entry | None:
        """An entry recomputing ``t`` from the stored input of the op that made it, when that
        op offered a recipe and its input is stored by the same compressor (or as is)."""
        found = self._recipes.get(key) or self._autocast_copy(t, site)
        if found is None or found[0]() is None:
            carried = self._carried_in_call(t, site)
            if carried is None:
                return None
            rec, source_refs = carried
        else:
            rec, source_refs = found[1], found[2]
        sources = []
        for source_ref, shape in source_refs:
            source = source_ref()
            if (
                source is None
                or source.value is _RELEASED
                or (source.compressor is not compressor and source.compressor is not None)
            ):
                return None
            sources.append((source, shape))
        self._derive(t, sources, compressor, site, row)
        return _Entry(
            _Recomputed(sources, rec, t.shape), compressor, site, t._version, t, watched=t
        )

    def _carried_in_call(self, t: torch.Tensor, site: Site) -> tuple[Recipe, _Sources] | None:
        """The output a carrying op saves itself (a softmax keeps its result): recomputable
        when its argument is, by the argument's recipe followed by the op (the result watcher
        sees the op only once it returned, after this save)."""
        func = OP_STATE.func
        if site.role != "output" or func is None or OP_STATE.raw not in CARRY_OPS:
            return None
        return self._carried(func, OP_STATE.args, OP_STATE.kwargs, t)

    def _autocast_copy(
        self, t: torch.Tensor, site: Site
    ) -> tuple[weakref.ref[torch.Tensor], Recipe, _Sources] | None:
        """Under autocast a projection saves its input cast to the autocast dtype, a copy no
        recipe names (a LayerNorm's fp32 output, cast to bf16 inside ``linear``). When
        autograd's graph shows the saved tensor is a view of such a cast of the op's first
        argument (:func:`_cast_of`), it is the argument's recipe, cast the same way."""
        if site.op not in AUTOCAST_CASTING_OPS or not OP_STATE.args:
            return None
        x = OP_STATE.args[0]
        if (
            not isinstance(x, torch.Tensor)
            or x.dtype == t.dtype
            or x.numel() != t.numel()
            or not _cast_of(t, x)
        ):
            return None
        found = self._recipes.get(_dedupe_key(x))
        if found is None or found[0]() is None:
            return None
        ref, rec, sources = found
        dtype = t.dtype
        return ref, rec.then(lambda y: y.to(dtype)), sources

    def _count(self, t: torch.Tensor, entry: _Entry, row: Row) -> None:
        """Count a new entry: ``t``'s storage in stock's bytes, whole and once (a view or
        alias of a storage a live entry counted adds nothing: stock holds it once), and in the
        stored bytes each storage its value holds (a payload's at its full size)."""
        tally = self.tally
        row.raw_bytes += tally.raw_storages.count(t, entry)
        value = entry.value
        if isinstance(value, torch.Tensor | Packed):
            row.stored_bytes += tally.stored_storages.count(value, entry)
        elif isinstance(value, _Recomputed):  # a mask or scale its recipe holds alive
            for held in value.recipe.held():
                if storage_base(held) not in self._skip:
                    row.stored_bytes += tally.stored_storages.count(held, entry)
        if isinstance(value, Packed) and t.device.type != "cpu":
            row.host_bytes += value.nbytes("cpu")

    def _store_as_is(self, entry: _Entry, t: torch.Tensor) -> None:
        """Turn a compressed entry into the tensor itself, which a later op saves as is.

        Autograd keeps that tensor alive for the later op anyway; holding the earlier op's
        code beside it would cost more than stock (a ReLU's 1-bit mask next to the conv input
        it also is), so the earlier op reads the exact tensor instead: less memory, no loss.
        """
        packed = entry.value
        if isinstance(packed, _Recomputed):  # it held no bytes: now the tensor's
            row = self.tally.row(entry.site)
            row.stored_bytes += self.tally.stored_storages.count(t, entry)
            row.derived -= 1
            value = t.detach()
            entry.value = value if value.shape == packed.shape else value.view(packed.shape)
            entry.compressor = None
            entry.variant = ""
            return
        if not isinstance(packed, Packed):
            return
        row = self.tally.row(entry.site)
        row.stored_bytes += self.tally.stored_storages.count(t, entry) - packed.nbytes()
        if t.device.type != "cpu":
            row.host_bytes -= packed.nbytes("cpu")
        row.compressed -= 1
        value = t.detach()
        entry.value = value if value.shape == packed.shape else value.view(packed.shape)
        entry.compressor = None
        entry.variant = ""

    def _remember(self, key: tuple[Any, ...], entry: _Entry) -> None:
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
            if save_kind(SDPA, site.role, t, OP_STATE.args) != "source":
                return None, FUSED_OUTPUT_REASON
            if not may_replay_attention(t.device, OP_STATE.args, OP_STATE.kwargs):
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
    ) -> _Entry:
        """Store ``t`` (its bytes are counted by :meth:`_count`)."""
        value: torch.Tensor | Packed = t.detach()
        if compressor is not None:
            try:
                out = compressor.compress(t.detach(), site)
            except KEEP_TYPE as e:
                e.add_note(
                    f"torchstash: raised in forward by {self._who(compressor)} compressing the "
                    f"{_tensor(site, t.shape, t.dtype)}; {_FORWARD_STATE}"
                )
                raise
            except Exception as e:
                raise CompressionError(
                    f"{self._who(compressor)} failed to compress the "
                    f"{_tensor(site, t.shape, t.dtype)}: {type(e).__name__}: {e}. "
                    f"It was raised in forward: {_FORWARD_STATE}. {self._advice(compressor, site)}"
                ) from e
            if isinstance(out, Packed):
                value = out
                row.compressed += 1
            else:
                reason = f"{compressor.name} declined it"
                compressor = None
        if reason:
            row.declined[reason] += 1
        entry = _Entry(
            value,
            compressor,
            site,
            t._version,
            t if self.dedupe else None,
            watched=t if isinstance(value, Packed) else None,
        )
        entry.reason = reason
        return entry

    def _types(self, site: Site) -> frozenset[str]:
        frames = self._tls.frames
        return frames[-1].info.type_names if frames else frozenset()

    def unpack(self, saved: _Saved) -> torch.Tensor:
        value = self._restore(saved.entry)
        return value if saved.shape is None else value.reshape(saved.shape)

    def _restore(self, entry: _Entry) -> torch.Tensor:
        value = entry.value
        if value is _RELEASED:
            raise CompressionError(
                f"the {_tensor(entry.site, (), None)} was released when an earlier backward "
                "through this graph raised; run the forward pass again"
            )
        version = entry.modified()
        if version is not None:
            self._release(entry)
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by "
                f"an inplace operation: the {tuple(value.shape)} tensor "
                f"({entry.site.describe()}) is at version {version}; expected version "
                f"{entry.version} instead. Avoid the in-place op or clone before it."
            )
        if isinstance(value, _Recomputed):
            out = entry.cache
            if out is None:
                operands = [self._restore(e).reshape(shape) for e, shape in value.sources]
                try:
                    out = value.recipe(*operands).reshape(value.shape)
                except RuntimeError as e:
                    e.add_note(
                        f"torchstash: raised recomputing the "
                        f"{_tensor(entry.site, value.shape, None)} from its op's stored inputs"
                    )
                    raise
            entry.pending -= 1
            entry.cache = out if entry.pending > 0 else None
            return out
        if isinstance(value, torch.Tensor):
            return value
        compressor = entry.compressor
        assert compressor is not None
        try:
            return compressor.decompress(value)
        except KEEP_TYPE as e:
            released = self._release(entry)
            e.add_note(
                f"torchstash: raised in backward by {self._who(compressor)} restoring the "
                f"{_tensor(entry.site, value.shape, value.dtype)}; {released}; {_BACKWARD_STATE}"
            )
            raise
        except Exception as e:
            released = self._release(entry)
            raise CompressionError(
                f"{self._who(compressor)} failed to restore the "
                f"{_tensor(entry.site, value.shape, value.dtype)}: {type(e).__name__}: {e}. "
                f"It was raised in backward: {_BACKWARD_STATE}; {released}. "
                f"{self._advice(compressor, entry.site)}"
            ) from e

    # -- faults -------------------------------------------------------------------------------

    def _release(self, entry: _Entry) -> str:
        """Release what the failing entry's forward pass stored; says what went back."""
        graph = entry.graph
        count, nbytes = graph.release() if graph is not None else (0, 0)
        return (
            f"torchstash released the {count} tensors ({nbytes / 2**20:.2f} MiB) that forward "
            "pass stored, so a following backward through the same graph raises"
        )

    def _strategy(self, compressor: Compressor) -> str | None:
        """The policy strategy that built ``compressor`` (None for an op's own codec).

        ``apply`` and ``stash`` resolve with a :class:`~torchstash.plan.Plan`'s bound method;
        its ``built`` rules name the strategy behind each compressor.
        """
        plan = getattr(self.resolve, "__self__", None)
        for built in getattr(plan, "built", {}).values():
            if getattr(built, "compressor", None) is compressor:
                return str(built.name)
        return None

    def _who(self, compressor: Compressor) -> str:
        """``strategy 'a' (compressor 'b', module.Class, from dist 1.0)``."""
        cls = type(compressor)
        parts = [f"compressor {compressor.name!r}", f"{cls.__module__}.{cls.__qualname__}"]
        strategy = self._strategy(compressor)
        provider = _providers(strategy) if strategy else ""
        if provider:
            parts.append(f"from {provider}")
        head = f"strategy {strategy!r}" if strategy else "the op's own codec"
        return f"{head} ({', '.join(parts)})"

    def _advice(self, compressor: Compressor, site: Site) -> str:
        """What to do: a policy rule that leaves the site out, and whom to tell."""
        if site.module:
            rule: dict[str, str] = {"module": site.module, "strategy": "none"}
            what = f"module {site.module!r}"
        else:
            rule = {"op": site.op, "role": site.role, "strategy": "none"}
            what = "that tensor"
        strategy = self._strategy(compressor)
        provider = (_providers(strategy) if strategy else "") or (
            f"the maintainers of {type(compressor).__module__}"
        )
        return (
            f"To train on, leave {what} out with the policy rule {rule!r} placed last, "
            f"or report this to {provider}"
        )


#: autograd nodes of a copy to another dtype and of views: a chain of them from ``t`` to
#: ``x`` makes ``t`` a view of ``x``'s cast
_CAST_NODES = frozenset(
    {"ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}
)


#: autograd nodes of a copy and of layout changes, between a parameter and its saved copy
_COPY_NODES = _CAST_NODES | {"TBackward0", "TransposeBackward0", "PermuteBackward0"}


def _parameter_copy(t: torch.Tensor) -> bool:
    """A parameter in another dtype or layout (autocast's bf16 copy of a weight, transposed
    for the matmul): kept like the parameter itself, as is and outside the activations'
    count. At 2 bits such a copy took the bench zoo's ViT gradient cosine under bf16
    autocast from 0.99 to 0.72 (every input gradient is computed with it).

    A trainable parameter's copy is read from its graph, which ends at the parameter; a
    frozen one's has no graph, and is the running op's Parameter argument of its size in
    another dtype (unless the op's first argument has that size too)."""
    if not t.is_floating_point():
        return False
    if t.grad_fn is not None:
        for node in _copy_chain(t, _COPY_NODES):
            variable = getattr(node, "variable", None)
            if variable is not None:
                return isinstance(variable, torch.nn.Parameter)
        return False
    if t.requires_grad:
        return False
    args = OP_STATE.args
    for a in args:
        if isinstance(a, torch.nn.Parameter) and a.numel() == t.numel() and a.dtype != t.dtype:
            first = args[0] if args else None
            return not (
                isinstance(first, torch.Tensor) and first is not a and first.numel() == t.numel()
            )
    return False


def _copy_chain(t: torch.Tensor, nodes: frozenset[str], depth: int = 3) -> Iterator[Any]:
    """The autograd nodes ``t`` was made from, one step back at a time, while each step is
    one of ``nodes`` (copies and views): at most ``depth`` of them."""
    node = t.grad_fn
    for _ in range(depth):
        if node is None or node.name() not in nodes or not node.next_functions:
            return
        node = node.next_functions[0][0]
        if node is None:
            return
        yield node


def _cast_of(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether autograd made ``t`` from ``x`` by a dtype copy and views alone (the autocast
    cast of a projection's input, reshaped to 2-d), read from ``t``'s graph: exact, no pass
    over the values."""
    target = x.grad_fn
    return target is not None and any(n is target for n in _copy_chain(t, _CAST_NODES))


def _version_alias(t: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor that shares ``t``'s version counter (and so its views' and base's):
    ``detach`` shares the counter, and assigning ``.data`` swaps the storage out without
    touching it. Holds no memory of ``t``'s. None for a tensor type that cannot do this."""
    try:
        alias = t.detach()
        alias.data = t.new_empty(0)
    except Exception:  # a tensor subclass or layout without .data: no check, as before
        return None
    return alias


def _dedupe_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Saves with equal keys hold the same values. Contiguous tensors over the same memory
    match whatever their shape (``att`` and the ``(B*H, N, N)`` view matmul saves of it), so
    an attention map is stored once."""
    if t.is_contiguous():
        return (t.data_ptr(), t.dtype, t.device, t.numel(), t._version)
    return (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride(), t._version)


def _variant(compressor: Compressor | None, t: torch.Tensor, site: Site) -> str:
    """How ``compressor`` stores ``t`` at ``site`` (optional ``variant`` method): entries are
    shared between saves of one tensor only when this agrees."""
    variant = getattr(compressor, "variant", None)
    return variant(t, site) if variant is not None else ""


def _op_call() -> OpCall:
    """The running op's call, for the site of what it saves."""
    state = OP_STATE
    return OpCall(tuple(state.args), state.kwargs, functools.partial(wait_for, state.call_id))


def _leave_tracker() -> None:
    OP_STATE.depth -= 1


_FORWARD_STATE = "the parameters, gradients and optimizer state are as they were"
_BACKWARD_STATE = (
    "the parameters and optimizer state are as they were, but gradients may be partly "
    "accumulated: zero them (optimizer.zero_grad()) before the next step"
)


def _tensor(site: Site, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype | None) -> str:
    """``(4, 16) torch.float32 tensor linear.input saved in module 'fc' (Linear)``."""
    what = f"{tuple(shape)} {dtype} tensor" if dtype is not None else "tensor"
    where = f"module {site.module!r}" if site.module else "<top level>"
    op = f"{site.op}.{site.role}" if site.op else (site.role or "tensor")
    return f"{what} {op} saved in {where} ({site.module_type or 'no module'})"


def _providers(strategy: str) -> str:
    """The distributions (with versions) that registered each part of ``strategy``."""
    from .registry import IN_PROCESS, REGISTRY

    found: list[str] = []
    for part in strategy.split(">"):
        try:
            spec = REGISTRY.get(part.strip())
        except Exception:  # not in the global registry (a Plan built on another): say nothing
            continue
        who = f"{spec.distribution} {spec.version}".strip()
        if spec.distribution != IN_PROCESS and who not in found:
            found.append(who)
    return " and ".join(found)
