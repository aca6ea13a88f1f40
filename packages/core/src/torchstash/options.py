"""Strategy options checked against the factory's annotations, before the factory runs.

Options arrive as text (``quant.int8:stochastic=no`` on the command line, a TOML table), so
a wrong type is common; left to the factory, ``bool("no")`` is True and ``int("abc")`` a bare
ValueError. Checking here covers every plug-in at once. Only plain types are checked (bool,
int, float, None, Literal, tuples and lists of them, unions); any other annotation is left to
the factory, and so is one that admits any string (``int | str | None``): the factory narrows
those strings itself, with a message that says which it takes.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import sys
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from .errors import OptionError

_NAMES = {bool: "True or False", int: "an integer", float: "a number"}


def check(strategy: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Raise :class:`OptionError` naming the first option whose value its annotation rejects."""
    hints = _hints(factory)
    for key, value in options.items():
        hint = hints.get(key)
        if hint is not None and _known(hint) and not _fits(value, hint):
            raise OptionError(
                f"strategy {strategy!r}: option {key}={value!r} must be {_describe(hint)}"
            )


def _hints(factory: Callable[..., Any]) -> dict[str, Any]:
    """Each parameter's annotation, evaluated one by one: one that does not resolve (a name
    imported only for type checkers) is skipped, not fatal."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return {}
    scope = _scope(factory)
    out: dict[str, Any] = {}
    for p in params:
        ann = p.annotation
        if isinstance(ann, str):
            try:
                ann = eval(ann, scope)  # as typing.get_type_hints does
            except Exception:
                continue
        if ann is not inspect.Parameter.empty:
            out[p.name] = ann
    return out


def _scope(factory: Callable[..., Any]) -> dict[str, Any]:
    """Where ``factory``'s string annotations resolve: its function's globals (through a
    ``functools.partial``), or a class's module (a factory made of a config type wraps it:
    :func:`~torchstash.declare.configured`)."""
    target: Any = inspect.unwrap(factory)
    while isinstance(target, functools.partial):
        target = target.func
    scope = getattr(target, "__globals__", None)
    if scope is None:
        module = sys.modules.get(getattr(target, "__module__", "") or "")
        scope = vars(module) if module is not None else {}
    return dict(scope)


def _args(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _known(hint: Any) -> bool:
    """Whether every part of ``hint`` is a type this module checks."""
    origin = typing.get_origin(hint)
    if hint in _NAMES or hint is type(None) or hint is None:
        return True
    if origin is typing.Literal:
        return True
    if _is_union(hint):
        return all(_known(a) for a in _args(hint))
    if origin in (tuple, list):
        return all(a is Ellipsis or _known(a) for a in _args(hint))
    return False


def _fits(value: Any, hint: Any) -> bool:
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in _args(hint))
    if _is_union(hint):
        return any(_fits(value, a) for a in _args(hint))
    if origin in (tuple, list) and isinstance(value, (tuple, list)):
        args = _args(hint)
        if not args:
            return True
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return all(_fits(v, args[0]) for v in value)
        return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
    return False


def _describe(hint: Any) -> str:
    if hint is None or hint is type(None):
        return "None"
    if hint in _NAMES:
        return _NAMES[hint]
    if typing.get_origin(hint) is typing.Literal:
        return " or ".join(repr(a) for a in _args(hint))
    if _is_union(hint):
        parts = [_describe(a) for a in _args(hint)]
        return ", ".join(parts[:-1]) + " or " + parts[-1] if len(parts) > 1 else parts[0]
    args = [a for a in _args(hint) if a is not Ellipsis]
    kind = "a tuple" if typing.get_origin(hint) is tuple else "a list"
    items = " / ".join(dict.fromkeys(_describe(a) for a in args))
    return f"{kind} whose items are each {items}" if args else kind
