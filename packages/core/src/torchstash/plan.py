"""From a policy to working parts: each rule's strategy built once, and per-site resolution."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import nn

from .compressor import Composed, Compressor
from .errors import OptionError, PolicyError, RegistryError
from .policy import Policy, Rule
from .registry import IN_PROCESS, Registry, resolved
from .site import Site

CHAIN = ">"


@dataclass(frozen=True)
class Swapped:
    """A rewrite done in place (the module's class swapped for a memory-saving subclass):
    parameters, buffers, hooks, ``training`` and every attribute stay the module's own, so
    nothing goes stale while it is applied. ``undo`` puts the original class back."""

    module: nn.Module
    undo: Callable[[], None]


@runtime_checkable
class Rewriter(Protocol):
    """A strategy part that swaps modules for memory-saving ones (memsave's layers)."""

    name: str

    def rewrite(self, module: nn.Module) -> nn.Module | Swapped | None:
        """The replacement for ``module`` (sharing its parameters), the same module changed in
        place (:class:`Swapped`), or None to keep it."""
        ...


@dataclass(frozen=True)
class Built:
    """What one rule's strategy provides: a compressor for saved tensors, module rewriters."""

    name: str
    compressor: Compressor | None
    rewriters: tuple[Rewriter, ...]
    lossless: bool


def build(strategy: str, options: Mapping[str, Any], registry: Registry | None = None) -> Built:
    """Build ``strategy`` (``a>b`` chains: rewriters from every part, compressors composed)."""
    reg = resolved(registry)
    parts = [p.strip() for p in strategy.split(CHAIN)]
    if any(not p for p in parts):
        raise RegistryError(f"malformed strategy {strategy!r}: write 'a' or 'a>b'")
    if len(parts) > 1:
        unknown = set(options) - set(parts)
        if unknown:
            raise OptionError(
                f"options for the chain {strategy!r} must be keyed by part name "
                f"({', '.join(parts)}), got {sorted(unknown)}"
            )
    compressors: list[Compressor] = []
    rewriters: list[Rewriter] = []
    lossless = True
    for part in parts:
        spec = reg.get(part)
        opts = options.get(part, {}) if len(parts) > 1 else options
        obj = spec.create(**dict(opts))
        lossless = lossless and spec.lossless
        provides = False
        if isinstance(obj, Rewriter):
            rewriters.append(obj)
            provides = True
        if isinstance(obj, Compressor):
            compressors.append(obj)
            provides = True
        if obj is None:
            provides = True  # "none": store as is
        if not provides:
            raise RegistryError(
                f"strategy {part!r} ({spec.distribution}) built {obj!r}, which is neither a "
                f"compressor (compress/decompress/unsupported) nor a rewriter (rewrite)"
            )
    compressor: Compressor | None = None
    for c in compressors:
        compressor = c if compressor is None else Composed(compressor, c)
    return Built(strategy, compressor, tuple(rewriters), lossless)


class Plan:
    """A policy with every rule built; resolves a site to its compressor."""

    def __init__(self, policy: Policy, registry: Registry | None = None) -> None:
        self.policy = policy
        #: where the strategies, plug-in ops' codes and their distributions are looked up
        self.registry = resolved(registry)
        self.built: dict[int, Built] = {}
        for i, rule in enumerate(policy.rules):
            try:
                self.built[i] = build(rule.strategy, rule.options, self.registry)
            except (RegistryError, OptionError) as e:
                raise type(e)(f"{rule.source}: {e}") from e
        self._index = {id(r): i for i, r in enumerate(policy.rules)}
        #: plug-in ops' own codes (:class:`~torchstash.registry.OpDefault`), built once each
        self._defaults: dict[str, Compressor | None] = {}

    def built_for(self, rule: Rule) -> Built:
        return self.built[self._index[id(rule)]]

    def compressor(self, site: Site, type_names: frozenset[str]) -> Compressor | None:
        """The last matching rule's compressor; for a plug-in op with a default code, that
        code, unless the matching rule names the op itself."""
        rule = self.policy.resolve(site, type_names)
        if "." in site.func and (rule is None or rule.op != site.func):
            default = self.op_default(site.func)
            if default is not None:
                return default
        return None if rule is None else self.built_for(rule).compressor

    def op_default(self, func: str) -> Compressor | None:
        """The compressor plug-in op ``func`` asks for its saves, or None."""
        try:
            return self._defaults[func]
        except KeyError:
            pass
        found = self.registry.op_default(func)
        built = found.factory() if found is not None else None
        if built is not None and not isinstance(built, Compressor):
            raise RegistryError(
                f"the default of op {func!r} ({found.distribution if found else '?'}) built "
                f"{built!r}, which is not a compressor"
            )
        self._defaults[func] = built
        return built

    def strategy_of(self, compressor: Compressor) -> str | None:
        """The rule strategy that built ``compressor`` (None for a plug-in op's own code)."""
        for built in self.built.values():
            if built.compressor is compressor:
                return built.name
        return None

    def providers(self, strategy: str) -> str:
        """The distributions (with versions) that registered each part of ``strategy``."""
        found: list[str] = []
        for part in strategy.split(CHAIN):
            try:
                spec = self.registry.get(part.strip())
            except RegistryError:
                continue
            who = f"{spec.distribution} {spec.version}".strip()
            if spec.distribution != IN_PROCESS and who not in found:
                found.append(who)
        return " and ".join(found)

    def rewriters(self, site: Site, type_names: frozenset[str]) -> tuple[Rewriter, ...]:
        """Rewriters for a module: the last rule that can select a module decides."""
        for rule in reversed(self.policy.rules):
            if not rule.selects_tensors_only and rule.matches(site, type_names):
                return self.built_for(rule).rewriters
        return ()

    @property
    def has_rewriters(self) -> bool:
        return any(b.rewriters for b in self.built.values())

    @property
    def has_compressors(self) -> bool:
        return any(b.compressor is not None for b in self.built.values())

    def check_types(self, type_names: set[str]) -> None:
        """Every ``type``/``tag`` selector must name a known tag or a class in the model."""
        from .opnames import is_known_op
        from .tags import KNOWN_TAGS

        for rule in self.policy.rules:
            for key in ("type", "tag"):
                value = getattr(rule, key)
                if value is None or value in KNOWN_TAGS or value in type_names:
                    continue
                if key == "tag" and is_known_op(value):
                    continue
                raise PolicyError(
                    f"{rule.source}: unknown {key} {value!r}: no module of that type in the model "
                    f"and not a known tag ({', '.join(sorted(KNOWN_TAGS))})."
                )
