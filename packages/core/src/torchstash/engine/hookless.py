"""Hookless replay: a forward whose trace only keeps tensors as they are runs with no
saved-tensor hook at all.

A trace whose every move is a parameter, a tensor kept as is, or a second save of one
(``none``; ``memsave`` where its layers code nothing; any strategy on a model whose tensors are
all under ``min_bytes``) changes nothing a hook could change: autograd would hold exactly what
it holds with no hook. Where a few module calls hold codes (memsave's ReLU masks that no later
save stands in for), those calls alone run with the hooks on, each save replayed behind its
guard (:func:`~.replay.hooked_calls` says which, and when a trace cannot). Such a forward, once its trace has replayed whole behind every per-save
guard, runs hookless: stock PyTorch saves, checks versions and restores, and the engine adds
the trace's totals to the tally at the end, as a guarded replay of the same saves does. Stock's
host cost per saved tensor is then the engine's: the empty-hooks row of the speed bench costs
more than this does.

What a hook would have checked at each save is checked at the module calls the engine hears
anyway: the root's inputs (each tensor's shape, dtype, device and ``requires_grad``, the other
arguments' values), whether autocast is on, which parameters train, and at each module call the
module, its training flag and its first argument's shape, in the recorded order. A root that
differs takes the guarded replay (each save checked); a module call that differs is a guard
miss: the saves before it count as the trace says, the hooks go on for the rest of the forward
(kept exactly, counted one by one: :meth:`~.core.Engine._keep_missed`) and the next forward
records again. One forward in :data:`CHECK_EVERY` takes the guarded replay instead, and if it
misses there, this replayer stops going hookless: the model's saves change where no module call
shows it (a data-dependent shape or branch inside one forward), and between two checks the
tally counted the recording's saves. Gradients never depend on it: a hookless forward is
stock's. ``TORCHSTASH_HOOKLESS=off`` keeps the hooks on every forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import env

#: one forward in this many, among those that could go hookless, takes the guarded replay
CHECK_EVERY = 64

#: a module call of a recorded forward: the module (weakly), its training flag, its first
#: argument's shape (None: not a tensor), and how many saves the forward had made before it
Call = tuple[Any, bool, "torch.Size | None", int]

_top_hooks: Callable[[bool], Any] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None
)
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def enabled() -> bool:
    """Whether this torch tells which saved-tensor hooks are on (a hookless forward must know
    that none are) and the environment allows it."""
    return _top_hooks is not None and env.get(env.HOOKLESS, "on").lower() not in OFF


OFF = ("off", "0", "false", "no")


def no_hooks_on() -> bool:
    """No saved-tensor hook is on on this thread: a forward without ours saves as stock."""
    assert _top_hooks is not None
    return _top_hooks(False) is None


def first_shape(args: Sequence[Any]) -> torch.Size | None:
    """The shape of a module call's first argument, when it is a tensor."""
    if args:
        a = args[0]
        if isinstance(a, torch.Tensor):
            return a.shape
    return None


def _value_key(v: Any, depth: int = 0) -> Any:
    if isinstance(v, torch.Tensor):
        return (v.shape, v.dtype, v.device, v.requires_grad)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if depth < 3 and isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(x, depth + 1) for x in v))
    if depth < 3 and isinstance(v, Mapping):
        return (type(v), tuple((k, _value_key(x, depth + 1)) for k, x in v.items()))
    return (type(v), id(v))  # an object: the same one, or the guarded replay decides


def root_key(
    args: Sequence[Any], kwargs: Mapping[str, Any] | None, state: Callable[[], Any] | None
) -> tuple[Any, ...]:
    """What the root module's call must match for a hookless forward: its arguments, autocast,
    and the model's parameters' ``requires_grad`` (``state``)."""
    return (
        tuple(_value_key(a) for a in args),
        tuple((k, _value_key(v)) for k, v in kwargs.items()) if kwargs else (),
        _any_autocast(),
        state() if state is not None else None,
    )


class Cursor:
    """Where a hookless forward is in its trace: the trace, the position of its next module
    call, and the module calls running (info, module, position), whose frames a guard miss
    makes."""

    __slots__ = ("calls", "island", "islands", "position", "stack", "trace")

    def __init__(self, trace: Any, calls: tuple[Call, ...]) -> None:
        self.trace = trace
        self.calls = calls
        self.position = 1  # the root's call is checked as the forward starts
        self.stack: list[tuple[Any, object, int]] = []
        #: the trace's module calls that run with the hooks on (``Trace.islands``), and the
        #: one running: its module, its end move and its hooks
        self.islands: dict[int, tuple[int, int, int]] = trace.islands
        self.island: tuple[object, int, Any] | None = None


class Hookless:
    """An outermost activation that runs a lean trace with no hook; ``close()`` leaves it (and
    the hooks a guard miss put on part way, when it did)."""

    __slots__ = ("deactivate", "hooks", "open")

    def __init__(self, deactivate: Callable[[], None]) -> None:
        self.deactivate = deactivate
        self.hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.open = True

    def __enter__(self) -> Hookless:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def hook(self, pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], Any]) -> bool:
        """Put the engine's hooks on for the rest of the forward (a guard missed); False when
        another's are on, which this forward then leaves as they are."""
        if not no_hooks_on():
            return False
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self.hooks = hooks
        return True

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        hooks, self.hooks = self.hooks, None
        try:
            if hooks is not None:
                hooks.__exit__(None, None, None)
        finally:
            self.deactivate()


__all__ = ["CHECK_EVERY", "Call", "Cursor", "Hookless", "enabled", "first_shape", "root_key"]
