"""The engine told of each module call, by an entry on the module rather than hooks.

The engine names every save by the module whose forward makes it, so it hears of every module
call. A forward pre-hook and an always-called forward hook on each module did that; but a
module with any hook leaves ``nn.Module._call_impl``'s fast path for one that walks the hook
dicts, the global hooks and the always-called set. On the speed bench's host-bound model (64
``Linear(32, 32)`` + GELU) that path alone cost about 9 us a saved tensor, where an empty
function around the call costs 1.5 (README, "Speed"). So each module gets ``_call_impl`` on
its instance (``nn.Module.__call__`` looks it up there): a function that tells the engine and
calls the class's own ``_call_impl``, which, with no hook of ours, takes the fast path.

A module that already has ``_call_impl`` or ``__call__`` on its instance (the applied model's
compile entry, :mod:`.compiling`, or another library's) keeps the hooks: an entry is never
stacked on someone else's. ``copy.deepcopy`` of a module binds its entry to the copy, as its
hooks were copied with it; so does ``nn.DataParallel``'s replication, which copies a module's
``__dict__`` and would otherwise leave each replica calling the original
(:mod:`.replicas`).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from .replicas import rebind_replicas, unbind_replicas

#: the attributes an entry is, or that keep a module on hooks when already set
_ENTRY_NAMES = ("_call_impl", "__call__")


def takes_entry(module: nn.Module) -> bool:
    """Whether ``module`` can take a call entry: nothing sits on its instance already."""
    return not any(name in module.__dict__ for name in _ENTRY_NAMES)


class Listener(Protocol):
    """What an entry tells of each eager call (the engine, :mod:`.engine.scope`); looked up
    at each call, so a wrapper put on the engine later (the speed bench's timer) sees them."""

    def enter_module(
        self, info: Any, owner: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None: ...

    def exit_module(self, owner: nn.Module) -> None: ...


class CallEntry:
    """``listener.enter_module(info, module, args, kwargs)`` before and ``listener.exit_module(module)``
    after each eager call of ``module`` (also when it raises); ``traced()`` instead while
    dynamo traces it. ``remove`` takes it off."""

    def __init__(
        self, module: nn.Module, listener: Listener, info: Any, traced: Callable[[], None]
    ) -> None:
        is_compiling = torch.compiler.is_compiling  # constant-folded by dynamo as it traces

        def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if is_compiling():
                traced()
                return type(self)._call_impl(self, *args, **kwargs)
            listener.enter_module(info, self, args, kwargs)
            try:
                return type(self)._call_impl(self, *args, **kwargs)
            finally:
                listener.exit_module(self)

        self._function = call
        self._module = weakref.ref(module)
        object.__setattr__(module, "_call_impl", types.MethodType(call, module))
        rebind_replicas(module)

    def remove(self) -> None:
        """Take the entry off its module (and off a copy's, were one made: each copy is its
        own module, whose entry its handle does not own; a copy keeps its entry)."""
        module = self._module()
        if module is None:
            return
        bound = module.__dict__.get("_call_impl")
        if isinstance(bound, types.MethodType) and bound.__func__ is self._function:
            del module.__dict__["_call_impl"]
            unbind_replicas(module)
