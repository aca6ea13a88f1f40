"""The strategy registry: one registration path, entry-point discovery, strict about clashes.

A plug-in declares one entry point in the group ``torchstash.plugins``; its name is the prefix
the plug-in owns (``quant`` owns ``quant`` and ``quant.*``) and its value a ``register(registry)``
function that calls :meth:`Registry.register` -- the same call a user makes in-process.
Plug-ins load lazily, by the prefix of the name asked for. A plug-in that fails to load breaks
only requests for its own prefix, with the cause chained; whatever it registered before failing
is taken back. A clash (a prefix claimed twice, a name offered twice) keeps the first provider
and fails every request under the clashing prefix, naming both sides, as pluggy does: picking
one silently would run code the user did not choose.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.metadata as metadata
import inspect
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Required, TypedDict, TypeVar, Unpack

from . import env
from . import options as _options
from .compressor import AS_IS
from .errors import (
    DuplicateStrategyError,
    OptionError,
    PluginLoadError,
    RegistryError,
    UnknownStrategyError,
)

_T = TypeVar("_T")

GROUP = "torchstash.plugins"
IN_PROCESS = "<in-process>"

Factory = Callable[..., Any]


@dataclass(frozen=True)
class Strategy:
    """A named way to save less: ``factory(**options)`` builds a compressor and/or rewriter."""

    name: str
    factory: Factory
    lossless: bool
    summary: str
    distribution: str
    version: str
    #: built from other strategies (an alias, a level): runnable by name, skipped by the demo
    #: and the bench unless asked for
    preset: bool = False
    #: offered to ``apply(budget_mb=...)`` when no candidates are given (see :meth:`Registry.candidates`)
    candidate: bool = False

    def options(self) -> list[str]:
        """Names of the options the factory accepts."""
        params = inspect.signature(self.factory).parameters.values()
        return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def describe(self) -> dict[str, Any]:
        """The row ``torchstash.strategies()`` and ``torchstash list --json`` show."""
        shown = ("name", "distribution", "version", "lossless", "summary")
        row = {key: getattr(self, key) for key in shown}
        return {
            **row,
            "options": self.options(),
            "preset": self.preset,
            "candidate": self.candidate,
        }

    def create(self, **kwargs: Any) -> Any:
        """Build the strategy's object (None for :data:`AS_IS`). An unknown or missing option,
        or a value its annotation rejects, is an :class:`OptionError`."""
        sig = inspect.signature(self.factory)
        try:
            sig.bind(**kwargs)
        except TypeError as e:
            accepted = ", ".join(self.options()) or "none"
            raise OptionError(
                f"strategy {self.name!r} cannot take options {sorted(kwargs)}: {e}. "
                f"It accepts: {accepted}."
            ) from None
        _options.check(self.name, self.factory, kwargs)
        obj = self.factory(**kwargs)
        if obj is None:
            raise RegistryError(
                f"strategy {self.name!r} from {_who(self.distribution, self.version)}: its "
                f"factory returned None. A factory returns a compressor, a rewriter, or "
                f"torchstash.AS_IS to store tensors as they are; report this to its maintainers."
            )
        return None if obj is AS_IS else obj


@dataclass(frozen=True)
class OpDefault:
    """A plug-in op's own code for what it saves (memsave's ReLU: a 1-bit mask of its output).

    The op names itself ``<prefix>.<name>`` in its sites (``Site.func``, set with
    :func:`torchstash.opmark.as_op`), so its plug-in loads when such a save is met. The default is
    a policy default: it applies under every policy, unless a rule names the op itself
    (``op = "memsave.relu"``), which then decides (``strategy = "none"`` keeps stock's save).
    """

    func: str
    factory: Factory
    summary: str
    distribution: str
    version: str

    def describe(self) -> dict[str, Any]:
        return {"op": self.func, "distribution": self.distribution, "version": self.version,
                "summary": self.summary}  # fmt: skip


@dataclass(frozen=True)
class PolicyFormat:
    """A policy file format a plug-in reads (see :meth:`Registry.register_policy_format`)."""

    name: str
    read: Callable[..., Iterable[Any]]
    summary: str
    suffixes: tuple[str, ...]
    fallback: bool
    distribution: str
    version: str


@dataclass(frozen=True)
class PluginRecord:
    """What happened when a plug-in's entry point was loaded."""

    prefix: str
    distribution: str
    version: str
    target: str
    loaded: bool
    error: BaseException | None = None
    disabled: bool = False


@dataclass(frozen=True)
class EntryPoint:
    """One entry point, with the distribution that declares it; ``prefix`` is its name (a
    plug-in's strategy prefix, a command's name)."""

    prefix: str
    target: str
    distribution: str
    version: str
    load: Callable[[], Any]


def _discover() -> list[EntryPoint]:
    """Entry points of every installed distribution, read from metadata (nothing imported)."""
    return entry_points_of(GROUP)


def entry_points_of(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` of every installed distribution, with the distribution
    that declares each, read from metadata (nothing imported)."""
    found: list[EntryPoint] = []
    seen: set[tuple[str, str]] = set()
    for dist in metadata.distributions():
        dist_name = dist.metadata["Name"] or "?"
        for ep in dist.entry_points:
            if ep.group != group or (dist_name, ep.name) in seen:
                continue
            seen.add((dist_name, ep.name))
            found.append(EntryPoint(ep.name, ep.value, dist_name, dist.version, ep.load))
    return found


#: This project's plug-ins, by the prefix each owns: an unknown name under one of these whose
#: distribution is missing is worth an install hint (a guessed name is not).
FIRST_PARTY_PLUGINS = {
    "quant": "torchstash-quant",
    "dropit": "torchstash-dropit",
    "memsave": "torchstash-memsave",
}


def _prefix(name: str) -> str:
    return name.split(".", 1)[0]


class Registry:
    """Strategies by name. ``discover`` lists entry points (replace it in tests)."""

    def __init__(
        self,
        discover: Callable[[], Iterable[EntryPoint]] = _discover,
        builtins: Callable[[Registry], None] | None = None,
    ) -> None:
        self._discover = discover
        self._builtins = builtins
        self._strategies: dict[str, Strategy] = {}
        self._op_defaults: dict[str, OpDefault] = {}
        self._formats: dict[str, PolicyFormat] = {}
        self._plugins: dict[str, PluginRecord] = {}
        self._entry_points: dict[str, list[EntryPoint]] | None = None
        self._loading: list[tuple[str | None, str, str]] = []  # (prefix, distribution, version)
        self._lock = threading.RLock()
        #: bumped by every registration and removal: what was built from names may be stale
        self.generation = 0

    @classmethod
    def fresh(cls, *, plugins: bool = True) -> Registry:
        """A registry of its own holding the core's strategies and, with ``plugins``, the
        installed plug-ins (found as the process's are): for a test or a tool that registers
        strategies without touching the process's (pass it as ``registry=``)."""
        return cls(discover=_discover if plugins else _nothing, builtins=_core_builtins)

    # -- registration -------------------------------------------------------------------------

    def register(
        self,
        name: str,
        factory: Factory,
        *,
        lossless: bool,
        summary: str,
        preset: bool = False,
        candidate: bool = False,
    ) -> Strategy:
        """Register ``name``. A name already taken is an error naming both providers.
        ``candidate``: offered to a memory budget by default (:meth:`candidates`)."""
        if not name or name.strip() != name or any(c in name for c in " >,"):
            raise RegistryError(f"invalid strategy name {name!r}: use letters, digits, '.', '_'")
        if not callable(factory):
            raise RegistryError(f"strategy {name!r}: factory must be callable, got {factory!r}")
        with self._lock:
            dist, version = self._provider(name)
            _refuse_twice(f"strategy {name!r}", self._strategies.get(name), dist, version)
            strategy = Strategy(
                name, factory, bool(lossless), summary, dist, version, preset, bool(candidate)
            )
            self._strategies[name] = strategy
            self.generation += 1
            return strategy

    def register_op_default(self, func: str, factory: Factory, *, summary: str) -> OpDefault:
        """Give the plug-in op ``func`` (``prefix.name``) a code of its own (see
        :class:`OpDefault`); ``factory()`` builds the compressor. Taken twice: an error."""
        if "." not in func or func.strip() != func or any(c in func for c in " >,"):
            raise RegistryError(
                f"invalid op name {func!r}: a plug-in's op is named '<prefix>.<name>'"
            )
        if not callable(factory):
            raise RegistryError(f"op {func!r}: factory must be callable, got {factory!r}")
        with self._lock:
            dist, version = self._provider(func)
            _refuse_twice(f"a default for op {func!r}", self._op_defaults.get(func), dist, version)
            default = OpDefault(func, factory, summary, dist, version)
            self._op_defaults[func] = default
            self.generation += 1
            return default

    def unregister_op_default(self, func: str) -> None:
        self._drop(self._op_defaults, func)

    def op_default(self, func: str) -> OpDefault | None:
        """The default code of plug-in op ``func``, loading the plug-in owning its prefix."""
        if "." not in func:
            return None
        with self._lock:
            self._ensure_builtins()
            self._load_prefix(_prefix(func))
            return self._op_defaults.get(func)

    def register_policy_format(
        self,
        name: str,
        read: Callable[..., Iterable[Any]],
        *,
        summary: str,
        suffixes: Iterable[str] = (),
        fallback: bool = False,
    ) -> PolicyFormat:
        """A policy file format besides TOML (Mesa's text: ``quant.mesa``): ``read(text,
        source, **options)`` returns its rules. ``Policy.load`` picks it for files ending in
        one of ``suffixes``, or, with ``fallback``, for any file no format claims."""
        if not callable(read):
            raise RegistryError(f"policy format {name!r}: read must be callable, got {read!r}")
        with self._lock:
            dist, version = self._provider(name)
            found = self._formats.get(name)
            _refuse_twice(f"policy format {name!r}", found, dist, version)
            form = PolicyFormat(name, read, summary, tuple(suffixes), bool(fallback), dist, version)
            self._formats[name] = form
            return form

    def policy_format(self, name: str) -> PolicyFormat:
        """The policy format ``name``, loading the plug-in owning its prefix."""
        with self._lock:
            self._ensure_builtins()
            self._load_prefix(_prefix(name))
            found = self._formats.get(name)
        if found is None:
            known = ", ".join(f.name for f in self.policy_formats()) or "none"
            raise UnknownStrategyError(
                f"unknown policy format {name!r}. Installed: toml, {known}. A plug-in may be "
                f"missing: pip install torchstash-{_prefix(name)}."
            )
        return found

    def policy_format_for(self, suffix: str) -> PolicyFormat | None:
        """The format that claims files ending in ``suffix``, else the fallback, else None."""
        forms = self.policy_formats()
        claimed = [f for f in forms if suffix in f.suffixes] or [f for f in forms if f.fallback]
        return claimed[0] if claimed else None

    def policy_formats(self) -> list[PolicyFormat]:
        return self._every(self._formats)

    def op_defaults(self) -> list[OpDefault]:
        """Every op default, after loading every plug-in (``torchstash list`` shows them)."""
        return self._every(self._op_defaults)

    def unregister(self, name: str) -> None:
        self._drop(self._strategies, name)

    def _drop(self, table: dict[str, Any], name: str) -> None:
        """Take ``name`` out of ``table`` (a loading plug-in only what its prefix owns)."""
        with self._lock:
            if self._loading:
                self._check_own(name, "unregister")
            table.pop(name, None)
            self.generation += 1

    def _provider(self, name: str) -> tuple[str, str]:
        """Who registers ``name`` now: the loading plug-in (which must own its prefix), or
        the running process."""
        if self._loading:
            return self._check_own(name, "register")
        self._ensure_builtins()  # so taking a core name fails here, not at first use
        return IN_PROCESS, ""

    def _check_own(self, name: str, verb: str) -> tuple[str, str]:
        """The loading plug-in's distribution and version, if ``name`` is under its prefix."""
        prefix, dist, version = self._loading[-1]
        if prefix is not None and _prefix(name) != prefix:
            raise RegistryError(
                f"plug-in {dist} (entry point {prefix!r}) tried to {verb} {name!r}; "
                f"a plug-in may only {verb} names under its own prefix ({prefix!r} or "
                f"'{prefix}.*'). Rename the strategy or the entry point."
            )
        return dist, version

    # -- lookup -------------------------------------------------------------------------------

    def get(self, name: str) -> Strategy:
        """The strategy called ``name``, loading the plug-in that owns its prefix if needed."""
        with self._lock:
            self._ensure_builtins()
            self._load_prefix(_prefix(name))  # always: a clash with a known name must surface
            record = self._plugins.get(_prefix(name))
            if record is not None and isinstance(record.error, DuplicateStrategyError):
                raise DuplicateStrategyError(f"cannot use {name!r}: {record.error}") from None
            try:
                return self._strategies[name]
            except KeyError:
                pass
            if record is not None and record.error is not None:
                raise PluginLoadError(
                    f"strategy {name!r} belongs to plug-in {record.distribution} "
                    f"{record.version}, which failed to load: {record.error!r}. "
                    f"Run `torchstash doctor` for details; reinstall or fix that plug-in."
                ) from record.error
            if record is not None and record.disabled:
                raise UnknownStrategyError(
                    f"strategy {name!r} belongs to plug-in {record.distribution}, disabled by "
                    f"{env.DISABLE_PLUGINS}={env.get(env.DISABLE_PLUGINS)!r}."
                )
            raise UnknownStrategyError(self._unknown(name, record))

    def _unknown(self, name: str, record: PluginRecord | None) -> str:
        """Why ``name`` is unknown and what to do: the closest installed names, and an install
        only for a plug-in of this project's that is missing (never ``torchstash-<typo>``)."""
        names = self.names()
        mine = [n for n in names if _prefix(n) == _prefix(name)] if record is not None else []
        close = difflib.get_close_matches(name, mine or names, n=3, cutoff=0.6)
        text = f"unknown strategy {name!r}"
        text += f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
        if record is not None:
            listed = ", ".join(mine) or "none"
            return f"{text} Plug-in {record.distribution} offers: {listed}."
        dist = FIRST_PARTY_PLUGINS.get(_prefix(name))
        if dist is not None:
            return f"{text} It would come from {dist}, which is not installed: pip install {dist}."
        return f"{text} Installed: {', '.join(names) or 'none'} (`torchstash list` describes them)."

    def names(self) -> list[str]:
        """Every strategy name, after loading every plug-in."""
        self.load_all()
        return sorted(self._strategies)

    def candidates(self) -> list[Strategy]:
        """The strategies a memory budget tries when not told which: those registered with
        ``candidate=True`` by what is installed, exact ones first, then in registration order."""
        self.load_all()
        found = [s for s in self._strategies.values() if s.candidate]
        return sorted(found, key=lambda s: not s.lossless)

    def strategies(self) -> list[Strategy]:
        return self._every(self._strategies)

    def plugins(self) -> list[PluginRecord]:
        """Every plug-in's load record (loads them all), for ``torchstash doctor``."""
        return self._every(self._plugins)

    def _every(self, table: dict[str, _T]) -> list[_T]:
        """``table``'s values by name, once every plug-in is loaded."""
        self.load_all()
        return [table[name] for name in sorted(table)]

    def load_all(self) -> None:
        with self._lock:
            self._ensure_builtins()
            for prefix in list(self._entry_point_map()):
                self._load_prefix(prefix)

    # -- plug-in loading ----------------------------------------------------------------------

    def _ensure_builtins(self) -> None:
        if self._builtins is not None:
            builtins, self._builtins = self._builtins, None
            from ._version import __version__

            with self._providing(None, "torchstash", __version__):
                builtins(self)

    def _entry_point_map(self) -> dict[str, list[EntryPoint]]:
        if self._entry_points is None:
            by_prefix: dict[str, list[EntryPoint]] = {}
            for ep in self._discover():
                by_prefix.setdefault(ep.prefix, []).append(ep)
            self._entry_points = by_prefix
        return self._entry_points

    def _load_prefix(self, prefix: str) -> None:
        """Load the plug-in owning ``prefix`` once. Its failure or clash goes into its record
        (raised by :meth:`get` for its names); only KeyboardInterrupt propagates."""
        if prefix in self._plugins or any(p == prefix for p, _, _ in self._loading):
            return
        eps = self._entry_point_map().get(prefix, [])
        if not eps:
            return
        ep = eps[0]
        if len(eps) > 1:
            sides = "\n".join(f"  {_who(e.distribution, e.version)} ({e.target})" for e in eps)
            err = DuplicateStrategyError(
                f"plug-in prefix {prefix!r} is claimed by {len(eps)} distributions:\n{sides}\n"
                f"Uninstall all but one, or disable one with {env.DISABLE_PLUGINS}."
            )
            dists = " and ".join(e.distribution for e in eps)
            versions = " and ".join(e.version for e in eps)
            self._plugins[prefix] = PluginRecord(prefix, dists, versions, ep.target, False, err)
            return
        if _disabled(ep):
            self._plugins[prefix] = PluginRecord(
                prefix, ep.distribution, ep.version, ep.target, False, disabled=True
            )
            return
        before = set(self._strategies)
        try:
            register = ep.load()
            if not callable(register):
                raise RegistryError(f"entry point {ep.target!r} is not callable")
            with self._providing(prefix, ep.distribution, ep.version):
                register(self)
        except KeyboardInterrupt:  # the user's, not the plug-in's: stop, and retry next time
            self._rollback(prefix, before)
            raise
        except BaseException as e:  # SystemExit too: a plug-in does not end the process
            self._rollback(prefix, before)
            self._plugins[prefix] = PluginRecord(
                prefix, ep.distribution, ep.version, ep.target, False, e
            )
            return
        self._plugins[prefix] = PluginRecord(prefix, ep.distribution, ep.version, ep.target, True)

    def _rollback(self, prefix: str, before: set[str]) -> None:
        """Take back what a failed plug-in registered (only its prefix: a plug-in it loaded
        on the way stays loaded)."""
        for name in set(self._strategies) - before:
            if _prefix(name) == prefix:
                del self._strategies[name]
        for table in (self._op_defaults, self._formats):
            for key in [k for k in table if _prefix(k) == prefix]:
                del table[key]

    @contextlib.contextmanager
    def _providing(self, prefix: str | None, dist: str, version: str) -> Iterator[None]:
        self._loading.append((prefix, dist, version))
        try:
            yield
        finally:
            self._loading.pop()


def _who(dist: str, version: str) -> str:
    return f"{dist} {version}".strip()


def _refuse_twice(what: str, existing: Any, dist: str, version: str) -> None:
    """A name offered twice is an error naming both providers (as pluggy's is)."""
    if existing is not None:
        raise DuplicateStrategyError(
            f"{what} is offered twice:\n"
            f"  by {_who(existing.distribution, existing.version)}\n"
            f"  by {_who(dist, version)}\n"
            f"Uninstall one of them, or disable one with "
            f"{env.DISABLE_PLUGINS}=<entry point or distribution>."
        )


def _disabled(ep: EntryPoint) -> bool:
    raw = env.get(env.DISABLE_PLUGINS)
    if not raw:
        return False
    names = {n.strip().lower() for n in raw.split(",") if n.strip()}
    return "*" in names or ep.prefix.lower() in names or ep.distribution.lower() in names


def _nothing() -> list[EntryPoint]:
    return []


def _core_builtins(registry: Registry) -> None:
    from .builtin import register

    register(registry)


#: The process-wide registry that :func:`torchstash.register_strategy` and ``apply`` use.
REGISTRY = Registry(builtins=_core_builtins)


def resolved(registry: Registry | None) -> Registry:
    """``registry``, or the process's (:data:`REGISTRY`) when None. Each public entry point
    (``apply``, ``stash``, ``strategies``, ``Plan``, ``Policy``'s readers, the budget planner)
    takes ``registry=`` and hands that one registry to everything it calls, so a test or a
    second registry is a parameter, never a patch of the global."""
    return REGISTRY if registry is None else registry


class Described(TypedDict, total=False):
    """What :meth:`Registry.register` takes of a strategy besides its name and factory."""

    lossless: Required[bool]
    summary: Required[str]
    preset: bool
    candidate: bool


def register_strategy(
    name: str, factory: Factory, *, registry: Registry | None = None, **how: Unpack[Described]
) -> Strategy:
    """Register a strategy in-process (plug-ins reach the same code through their entry point)."""
    return (registry or REGISTRY).register(name, factory, **how)
