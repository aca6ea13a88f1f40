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
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .casts import cast_of
from .opmark import (
    STATE,
    AutocastState,
    OpState,
    Watcher,
    autocast_now,
)
from .opnames import op_names
from .packed import storage_base

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


def autocast_state() -> AutocastState:
    """Where autocast is on, and at which dtype, for the torch call running now (as the
    tracker saw it when the call began: inside the op's kernel, where pack hooks run,
    autocast reads as off, its dispatch having switched itself off for the op's body)."""
    state = STATE
    return state.autocast if state.op else autocast_now()


class OpTracker(TorchFunctionMode):
    """Records the outermost torch call running, for the pack hook to read."""

    #: what :func:`~torchstash.opmark.untracked` looks for on the mode stack
    tracks_ops = True

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
        state.autocast = autocast_now()
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
