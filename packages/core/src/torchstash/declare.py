"""Strategies declared beside their factories, handed to a registry in one call.

A package's entry point (``register(registry)``) gives its table to the registry, which checks
each name as it always does (a name taken twice is an error naming both providers). One
decorator line a strategy, where its factory is defined, in place of a ``registry.register``
block each. Imports nothing of the registry (the registry calls the core's own table).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

__all__ = ["Declared", "Registering", "StrategyTable", "configured"]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C")


class Registering(Protocol):
    """What a table needs of a registry (:meth:`torchstash.registry.Registry.register`)."""

    def register(
        self,
        name: str,
        factory: Callable[..., Any],
        *,
        lossless: bool,
        summary: str,
        preset: bool = ...,
        candidate: bool = ...,
    ) -> object: ...


@dataclass(frozen=True, slots=True)
class Declared:
    """One strategy as :meth:`~torchstash.registry.Registry.register` takes it."""

    name: str
    factory: Callable[..., Any]
    lossless: bool
    summary: str
    #: a preset (a fixed configuration of another strategy): listed apart
    preset: bool = False
    #: offered to a memory budget by default
    candidate: bool = False


@dataclass
class StrategyTable:
    """A package's strategies, in the order declared."""

    declared: list[Declared] = field(default_factory=list)

    def strategy(
        self,
        name: str,
        *,
        lossless: bool,
        summary: str | None = None,
        preset: bool = False,
        candidate: bool = False,
    ) -> Callable[[F], F]:
        """Declare the decorated factory as ``name``; its ``summary`` (what ``torchstash
        strategies`` lists) is the first line of the factory's docstring unless given. Also
        callable on a built factory: ``table.strategy("quant.int2", ...)(factory)``."""

        def declare(factory: F) -> F:
            said = summary if summary is not None else _first_line(factory, name)
            self.declared.append(Declared(name, factory, lossless, said, preset, candidate))
            return factory

        return declare

    def register(self, registry: Registering) -> None:
        """Register every declared strategy with ``registry``."""
        for d in self.declared:
            registry.register(**{f.name: getattr(d, f.name) for f in fields(d)})


def configured(config: Callable[..., C], build: Callable[[C], Any]) -> Callable[..., Any]:
    """A strategy's factory made of a typed config and its handler: its options are
    ``config``'s parameters (a dataclass's fields, or a codec class's own), whose signature and
    annotations the registry reads and checks, and ``build`` turns the config into the
    compressor. The config's docstring is the strategy's; its annotations resolve in the
    config's module."""

    def factory(*args: Any, **options: Any) -> Any:
        return build(config(*args, **options))

    returns = inspect.signature(build).return_annotation
    factory.__signature__ = inspect.signature(config).replace(  # type: ignore[attr-defined]
        return_annotation=returns
    )
    factory.__doc__ = config.__doc__
    factory.__wrapped__ = config  # type: ignore[attr-defined]
    factory.__qualname__ = factory.__name__ = getattr(config, "__name__", "factory")
    return factory


def _first_line(factory: Callable[..., Any], name: str) -> str:
    """The first line of ``factory``'s docstring, without its full stop."""
    doc = inspect.getdoc(factory)
    if not doc:
        raise TypeError(
            f"strategy {name!r}: give summary= or a docstring to {factory!r} (its first line is "
            "the strategy's summary)"
        )
    return doc.splitlines()[0].rstrip(".")
