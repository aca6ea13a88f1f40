"""The op marker: what a plug-in's own ``autograd.Function`` tells the engine about the op it
runs, and the per-thread record of the op running now that the engine's tracker keeps.

A plug-in imports this module (public, importing nothing of the engine) rather than the
tracker (:mod:`torchstash.optrack`, the engine's side): :func:`as_op` names the op around a
Function's ``apply``, :func:`engine_active` says whether an engine takes the saves on this
thread, :func:`untracked` takes the tracker off for the Function's body. The state they read
and write, :data:`STATE`, is the one the tracker fills for stock ops.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import _get_current_function_mode as _current_function_mode
from torch.overrides import _pop_mode_temporarily

__all__ = [
    "AUTOCAST_DEVICES",
    "STATE",
    "AutocastState",
    "OpState",
    "Watcher",
    "as_op",
    "autocast_now",
    "engine_active",
    "tracking",
    "untracked",
]

#: ``callback(func, args, kwargs, result)``, told of a watched call's result
Watcher = Callable[[Callable[..., Any], Sequence[Any], dict[str, Any], Any], None]

#: Device types whose autocast state the tracker notes (for ops replayed in backward).
AUTOCAST_DEVICES = ("cpu", "cuda")

#: The autocast state an op ran under: (device type, dtype) for each device where it was on.
AutocastState = tuple[tuple[str, torch.dtype], ...]

_any_autocast: Callable[[], bool] | None = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_now() -> AutocastState:
    if _any_autocast is not None and not _any_autocast():
        return ()
    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in AUTOCAST_DEVICES
        if torch.is_autocast_enabled(device)
    )


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


class as_op:
    """Name the op running inside the block, for what a custom ``autograd.Function`` saves.

    The tracker sees torch calls, not a Function's ``apply``; a plug-in's Function (memsave's
    conv) wraps its ``apply`` in ``as_op("conv", (x, weight, bias))`` so its saves get the
    site a stock conv's would (op, role), and a policy can still select and compress them.
    ``func`` is the raw name sites report (default ``op``); a plug-in's own op is named
    ``<prefix>.<name>`` (``memsave.relu``), and may have a code of its own for what it saves,
    registered as a policy default (:meth:`~torchstash.registry.Registry.register_op_default`).
    A class, not a generator: it runs around every such layer's call, where contextlib's
    wrapper took three more Python calls each time.
    """

    __slots__ = ("_new", "_prev")

    def __init__(
        self,
        op: str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        func: str | None = None,
    ) -> None:
        self._new = (op, func or op, args, kwargs or {})
        self._prev: tuple[Any, ...] = ()

    def __enter__(self) -> None:
        state = STATE
        self._prev = (state.op, state.raw, state.func, state.args, state.kwargs, state.autocast)
        state.op, state.raw, state.args, state.kwargs = self._new
        state.func = None
        state.autocast = autocast_now()
        state.call_id += 1

    def __exit__(self, *exc: object) -> None:
        state = STATE
        state.op, state.raw, state.func, state.args, state.kwargs, state.autocast = self._prev


def engine_active() -> bool:
    """True while a torchstash engine takes the saves on this thread: recording them (its
    tracker on) or replaying a recorded forward (no tracker)."""
    return STATE.engines > 0


def tracking() -> bool:
    """True while an op tracker is on for this thread (an engine recording, or a region of a
    replayed forward): only then has :func:`untracked` anything to take off."""
    return STATE.depth > 0


_UNTOUCHED = contextlib.nullcontext()


def untracked() -> contextlib.AbstractContextManager[Any]:
    """The op tracker off the mode stack for the block, where it is the innermost mode: for a
    plug-in's ``autograd.Function`` call, named with :func:`as_op`. A stock op passes through
    the tracker once and runs its body with the mode popped; a Function's forward and the
    pack hooks it triggers would otherwise send each tensor method they call (``numel``,
    ``stride``...) through the tracker's Python handler, a microsecond each for nothing."""
    if STATE.depth and getattr(_current_function_mode(), "tracks_ops", False):
        return _pop_mode_temporarily()
    return _UNTOUCHED
