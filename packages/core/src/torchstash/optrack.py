"""Which op is running: a TorchFunctionMode that records the op around each torch call.

The pack hook runs inside the op that saves the tensor; this tracker lets it name that op
(``linear``, ``matmul``, ``softmax``...) and the tensor's role in it, so a policy can reach
``q @ k.transpose(-2, -1)`` or ``attn.softmax(-1)`` without editing the model.

A mode sees only the outermost call: ``F.multi_head_attention_forward`` would hide the
projections and the softmax inside it. Such composites are *opened*: the tracker runs a copy
of the function whose own ``has_torch_function`` check is off, with the mode still active,
so every op inside is seen under its own name (see :func:`opened`).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.overrides import _get_current_function_mode as _current_function_mode

from .casts import cast_of
from .packed import storage_base

# Raw function names that share one canonical op name.
_CANONICAL = {
    "mm": "matmul",
    "bmm": "matmul",
    "matmul": "matmul",
    "baddbmm": "matmul",
    "einsum": "matmul",
    "conv1d": "conv",
    "conv2d": "conv",
    "conv3d": "conv",
    "conv_transpose1d": "conv",
    "conv_transpose2d": "conv",
    "conv_transpose3d": "conv",
    "addmm": "linear",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "_softmax": "softmax",
    "batch_norm": "batch_norm",
    "sdpa": "scaled_dot_product_attention",
}

#: Canonical op names policies commonly select (others: any torch function's name).
KNOWN_OPS = frozenset(
    {
        "linear",
        "matmul",
        "conv",
        "softmax",
        "gelu",
        "silu",
        "hardswish",
        "relu",
        "layer_norm",
        "group_norm",
        "rms_norm",
        "batch_norm",
        "dropout",
        "embedding",
        "scaled_dot_product_attention",
        "max_pool",
        "avg_pool",
        "mul",
        "add",
        "tanh",
        "sigmoid",
    }
)

_names: dict[Any, tuple[str, str]] = {}

#: Python composites whose inner ops the tracker reports (the projections of
#: ``nn.MultiheadAttention``, its softmax and matmuls); see :func:`opened`.
OPENED_COMPOSITES: tuple[Callable[..., Any], ...] = (
    torch.nn.functional.multi_head_attention_forward,
)
_opened: dict[Any, Callable[..., Any] | None] = {}


def _no_torch_function(*_: Any) -> bool:
    return False


def opened(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """A copy of ``func`` that skips its own ``has_torch_function`` dispatch, or None.

    Only for :data:`OPENED_COMPOSITES`. The copy shares the function's code and defaults and
    sees its module's globals with that one name replaced, so the ops it calls still dispatch
    to the mode. None (the composite stays one op) when ``func`` is not a plain Python
    function that makes the check, as a future torch might define it.
    """
    if func in _opened:
        return _opened[func]
    copy = None
    code = getattr(func, "__code__", None)
    if (
        func in OPENED_COMPOSITES
        and isinstance(func, types.FunctionType)
        and code is not None
        and "has_torch_function" in code.co_names
        and not func.__closure__
    ):
        env = dict(func.__globals__)
        env["has_torch_function"] = _no_torch_function
        copy = types.FunctionType(code, env, func.__name__, func.__defaults__)
        copy.__kwdefaults__ = func.__kwdefaults__
        copy.__qualname__ = func.__qualname__
    _opened[func] = copy
    return copy


def op_names(func: Callable[..., Any]) -> tuple[str, str]:
    """(canonical, raw) names of a torch function, cached per function object."""
    hit = _names.get(func)
    if hit is None:
        raw = getattr(func, "__name__", None) or type(func).__name__
        base = raw.strip("_")
        if base.startswith("r") and raw.startswith("__r"):
            base = base[1:]  # __rmatmul__ -> matmul
        base = base.removesuffix("_")  # in-place variants (relu_) share the op
        for pool in ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"):
            if base.startswith(pool):
                base = pool.removeprefix("adaptive_")
        hit = (_CANONICAL.get(base, base), raw)
        _names[func] = hit
    return hit


def is_known_op(name: str) -> bool:
    """True for a canonical op name or the name of a function torch exposes."""
    if name in KNOWN_OPS or name in _CANONICAL:
        return True
    return any(
        hasattr(ns, name) or hasattr(ns, f"__{name}__")
        for ns in (torch, torch.Tensor, torch.nn.functional)
    )


#: ``callback(func, args, kwargs, result)``, told of a watched call's result
Watcher = Callable[[Callable[..., Any], Sequence[Any], dict[str, Any], Any], None]


#: Device types whose autocast state the tracker notes (for ops replayed in backward).
AUTOCAST_DEVICES = ("cpu", "cuda")

#: The autocast state an op ran under: (device type, dtype) for each device where it was on.
AutocastState = tuple[tuple[str, torch.dtype], ...]

_any_autocast: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_now() -> AutocastState:
    if _any_autocast is not None and not _any_autocast():
        return ()
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


def autocast_state() -> AutocastState:
    """Where autocast is on, and at which dtype, for the torch call running now (as the
    tracker saw it when the call began: inside the op's kernel, where pack hooks run,
    autocast reads as off, its dispatch having switched itself off for the op's body)."""
    state = STATE
    return state.autocast if state.op else _autocast_now()


class OpState(threading.local):
    """The op running on this thread (empty outside any torch call)."""

    def __init__(self) -> None:
        self.op = ""
        self.raw = ""
        #: the torch function running (None under :func:`as_op`)
        self.func: Callable[..., Any] | None = None
        self.args: Sequence[Any] = ()
        self.kwargs: dict[str, Any] = {}
        #: autocast as the running call found it (see :func:`autocast_state`)
        self.autocast: AutocastState = ()
        self.depth = 0  # trackers active on this thread
        self.engines = 0  # engines active on this thread (recording or replaying)
        self.call_id = 0  # increments at every tracked call
        #: (call id, callback) pairs waiting for that call's result; see :func:`on_result`
        self.waiting: list[tuple[int, Callable[[Any], None]]] = []
        #: (raw names, callback) pairs told of every such call's result; see :func:`watching`
        self.watchers: list[tuple[frozenset[str], Watcher]] = []


STATE = OpState()


class OpTracker(TorchFunctionMode):
    """Records the outermost torch call running, for the pack hook to read."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved: no work
            return func(*args, **(kwargs or {}))
        state = STATE
        kwargs = kwargs or {}
        prev = (state.op, state.raw, state.func, state.args, state.kwargs, state.autocast)
        state.op, state.raw = op_names(func)
        state.func, state.args, state.kwargs = func, args, kwargs
        state.autocast = _autocast_now()
        state.call_id += 1
        call_id = state.call_id
        inner = opened(func) if func in OPENED_COMPOSITES else None
        try:
            if inner is not None:
                with self:  # the mode is off inside its own handler: on again for the body
                    result = inner(*args, **kwargs)
            else:
                result = func(*args, **kwargs)
        finally:
            state.op, state.raw, state.func, state.args, state.kwargs, state.autocast = prev
        if state.waiting:
            _deliver(state, call_id, result)
        if state.watchers:
            raw = op_names(func)[1]
            for names, watcher in state.watchers:
                if raw in names:
                    watcher(func, args, kwargs, result)
        return result


def on_result(callback: Callable[[Any], None]) -> None:
    """Have ``callback(result)`` called when the op running now returns.

    For a pack hook that wants the op's output (to watch its gradient, say): the hook runs
    inside the op, before the output exists. Outside a tracked op the callback is dropped.
    """
    state = STATE
    if state.op:
        state.waiting.append((state.call_id, callback))


def wait_for(call_id: int, callback: Callable[[Any], None]) -> None:
    """:func:`on_result` for the call ``call_id`` (an :class:`~torchstash.site.OpCall`'s):
    dropped unless that call is the one running."""
    state = STATE
    if state.op and state.call_id == call_id:
        state.waiting.append((call_id, callback))


@contextlib.contextmanager
def watching(names: frozenset[str], callback: Watcher) -> Iterator[None]:
    """Inside the block, ``callback(func, args, kwargs, result)`` after every tracked call
    whose raw name is in ``names`` (ops that save nothing, such as a ``transpose``, included)."""
    state = STATE
    item = (names, callback)
    state.watchers.append(item)
    try:
        yield
    finally:
        state.watchers.remove(item)


def _deliver(state: OpState, call_id: int, result: Any) -> None:
    due = [cb for cid, cb in state.waiting if cid == call_id]
    # Earlier ids belong to calls that raised: nobody will deliver them.
    state.waiting = [(cid, cb) for cid, cb in state.waiting if cid > call_id]
    for callback in due:
        callback(result)


@contextlib.contextmanager
def as_op(
    op: str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    func: str | None = None,
) -> Iterator[None]:
    """Name the op running inside the block, for what a custom ``autograd.Function`` saves.

    The tracker sees torch calls, not a Function's ``apply``; a plug-in's Function (memsave's
    conv) wraps its ``apply`` in ``as_op("conv", (x, weight, bias))`` so its saves get the
    site a stock conv's would (op, role), and a policy can still select and compress them.
    ``func`` is the raw name sites report (default ``op``); a plug-in's own op is named
    ``<prefix>.<name>`` (``memsave.relu``), and may have a code of its own for what it saves,
    registered as a policy default (:meth:`~torchstash.registry.Registry.register_op_default`).
    """
    state = STATE
    prev = (state.op, state.raw, state.func, state.args, state.kwargs, state.autocast)
    state.op, state.raw, state.func = op, func or op, None
    state.args, state.kwargs, state.autocast = args, kwargs or {}, _autocast_now()
    state.call_id += 1
    try:
        yield
    finally:
        state.op, state.raw, state.func, state.args, state.kwargs, state.autocast = prev


def engine_active() -> bool:
    """True while a torchstash engine takes the saves on this thread: recording them (its
    tracker on) or replaying a recorded forward (no tracker)."""
    return STATE.engines > 0


_UNTOUCHED = contextlib.nullcontext()


def untracked() -> contextlib.AbstractContextManager[Any]:
    """The op tracker off the mode stack for the block, where it is the innermost mode: for a
    plug-in's ``autograd.Function`` call, named with :func:`as_op`. A stock op passes through
    the tracker once and runs its body with the mode popped; a Function's forward and the
    pack hooks it triggers would otherwise send each tensor method they call (``numel``,
    ``stride``...) through the tracker's Python handler, a microsecond each for nothing."""
    if STATE.depth and isinstance(_current_function_mode(), OpTracker):
        return _pop_mode_temporarily()
    return _UNTOUCHED


def op_argument(name: str, position: int, default: Any = None) -> Any:
    """An argument of the op running now, by keyword or position (a GELU's ``approximate``):
    for a code whose meaning depends on how the op was called."""
    state = STATE
    if name in state.kwargs:
        return state.kwargs[name]
    if len(state.args) > position:
        return state.args[position]
    return default


#: Ops whose in-place form saves a copy of its input, taken before the input is overwritten
#: (``silu_``, ``hardswish_`` and ``mul_`` read the original values in backward): that copy is
#: the op's input.
INPLACE_COPY_OPS = frozenset({"silu", "hardswish", "mul"})
_inplace_positions: dict[Any, int | None] = {}


def _inplace_position(func: Callable[..., Any]) -> int | None:
    """Where ``func`` takes ``inplace`` positionally (``F.silu(x, True)``), cached."""
    if func not in _inplace_positions:
        try:
            names = list(inspect.signature(func).parameters)
        except (TypeError, ValueError):  # a builtin without a signature
            names = []
        _inplace_positions[func] = names.index("inplace") if "inplace" in names else None
    return _inplace_positions[func]


def in_place(state: OpState | None = None) -> bool:
    """Whether the op running now writes its result into its first argument."""
    state = state or STATE
    if state.raw.endswith("_") and not state.raw.endswith("__"):
        return True  # relu_, Tensor.mul_
    if state.raw.startswith("__i"):
        return True  # Tensor.__imul__
    if state.kwargs.get("inplace") is True:
        return True
    if state.func is None:
        return False
    pos = _inplace_position(state.func)
    return pos is not None and len(state.args) > pos and state.args[pos] is True


def role_of(t: torch.Tensor) -> str:
    """``input`` or ``argN`` when the tensor is (a view of) the op's N-th tensor argument;
    ``output`` for anything the op made (its result, or a mask or index it computed). An
    in-place op of :data:`INPLACE_COPY_OPS` saves a copy of its first argument taken before
    overwriting it: that copy (same shape and dtype, another storage) is its ``input``, so
    the codes made for the op's input (a SiLU's derivative) reach ``nn.SiLU(inplace=True)``."""
    i = 0
    base = storage_base(t) if t.numel() else None  # the storage's address
    first: torch.Tensor | None = None
    for a in STATE.args:
        if isinstance(a, torch.Tensor):
            if a is t or (
                base is not None
                and a.numel() > 0
                and a.device == t.device
                and storage_base(a) == base
            ):
                return "input" if i == 0 else f"arg{i}"
            if i == 0:
                first = a
            i += 1
    if (
        first is not None
        and STATE.op in INPLACE_COPY_OPS
        and t.shape == first.shape
        and t.dtype == first.dtype
        and in_place()
    ):
        return "input"
    cast = _cast_argument(t) if STATE.autocast else None
    if cast is not None:
        return "input" if cast == 0 else f"arg{cast}"
    return "output"


def _cast_argument(t: torch.Tensor) -> int | None:
    """Which tensor argument of the running call ``t`` is autocast's cast of (its position
    among the tensor arguments), or None: read from ``t``'s graph (:func:`~.casts.cast_of`),
    or, where nothing needs a gradient through it, from its shape and floating dtype alone."""
    if not t.is_floating_point():
        return None
    tensors = [a for a in STATE.args if isinstance(a, torch.Tensor)]
    for i, a in enumerate(tensors):
        if t.grad_fn is not None:
            if cast_of(t, a):
                return i
        elif (
            not t.requires_grad
            and not a.requires_grad
            and a.is_floating_point()
            and a.dtype != t.dtype
            and a.shape == t.shape
        ):
            return i
    return None
