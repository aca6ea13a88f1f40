"""Policies: ordered rules that say which strategy saves which tensor.

A rule has selectors (all given ones must match) and a strategy with options. The **last**
matching rule wins, so a policy reads as defaults followed by exceptions (as Mesa's files do).
``strategy = "none"`` stores a tensor as is; ``enable = false`` is the same.

Selectors:
  ``type``   module type tag (``linear``, ``conv``, ``gelu``, ``bn``, ``fc``...) or class name
  ``index``  with ``type``: index (or list of indices) among the model's modules of that type
  ``module`` glob on the module's qualified name (``blocks.*.mlp``)
  ``op``     op that saved the tensor (``linear``, ``matmul``, ``softmax``, ``gelu``...), or a
             plug-in's own op (``memsave.relu``): a rule naming one overrides its default code
  ``op_index`` with ``op``: the op's occurrence index in one forward
  ``role``   the tensor's role in that op (``input``, ``arg1``, ``arg2``..., ``output``; a glob;
             autocast's copy of an argument has the argument's role)
  ``tag``    a ``type`` or an ``op`` (Mesa's tags cover modules and functional ops alike)
"""

from __future__ import annotations

import ast
import fnmatch
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import tags
from .errors import PolicyError
from .opnames import is_known_op
from .registry import Registry, resolved
from .site import Site
from .tomlheaders import header_lines

SELECTORS = ("type", "index", "module", "op", "op_index", "role", "tag")
RULE_KEYS = (*SELECTORS, "strategy", "options", "enable")
#: the roles a saved tensor can have (see :func:`torchstash.optrack.role_of`), for checking a
#: rule's ``role`` glob: one that matches none of them would silently select nothing
ROLES = ("input", *(f"arg{i}" for i in range(1, 100)), "output")


@dataclass(frozen=True)
class Rule:
    strategy: str = "none"
    options: Mapping[str, Any] = field(default_factory=dict)
    type: str | None = None
    index: frozenset[int] | None = None
    module: str | None = None
    op: str | None = None
    op_index: frozenset[int] | None = None
    role: str | None = None
    tag: str | None = None
    #: where the rule came from, for error messages ("rule 3 (policy.toml, line 12)")
    source: str = "rule"

    def __post_init__(self) -> None:
        if self.role is not None and not any(fnmatch.fnmatchcase(r, self.role) for r in ROLES):
            hint = _did_you_mean(self.role, ("input", "arg1", "arg2", "output"))
            raise PolicyError(
                f"{self.source}: unknown role {self.role!r}{hint}. A tensor's role in its op is "
                f"input, arg1, arg2, ... or output (a glob such as 'arg*' matches several)."
            )

    @property
    def selects_tensors_only(self) -> bool:
        """True when the rule needs an op or role, so it cannot pick a module to rewrite."""
        return self.op is not None or self.role is not None or self.op_index is not None

    def matches(self, site: Site, type_names: frozenset[str] = frozenset()) -> bool:
        names = type_names or frozenset({site.tag})
        if self.type is not None:
            if self.type not in names:
                return False
            if self.index is not None and site.module_index not in self.index:
                return False
        if self.tag is not None and self.tag not in names and self.tag != site.op:
            return False
        if self.module is not None and not fnmatch.fnmatchcase(site.module, self.module):
            return False
        if self.op is not None and self.op not in (site.op, site.func):
            return False
        if self.op_index is not None and site.op_index not in self.op_index:
            return False
        return self.role is None or fnmatch.fnmatchcase(site.role, self.role)


class Policy:
    """Ordered rules; :meth:`resolve` returns the last rule matching a site."""

    def __init__(self, rules: Sequence[Rule], name: str = "policy") -> None:
        self.rules = tuple(rules)
        self.name = name

    def __repr__(self) -> str:
        return f"Policy({self.name!r}, {len(self.rules)} rules)"

    def resolve(self, site: Site, type_names: frozenset[str] = frozenset()) -> Rule | None:
        for rule in reversed(self.rules):
            if rule.matches(site, type_names):
                return rule
        return None

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def single(cls, strategy: str, **options: Any) -> Policy:
        """Every tensor by one strategy."""
        return cls([Rule(strategy, dict(options), source=f"strategy {strategy!r}")], strategy)

    @classmethod
    def from_rules(
        cls,
        rules: Iterable[Mapping[str, Any] | Rule],
        name: str = "policy",
        *,
        registry: Registry | None = None,
    ) -> Policy:
        """Rules given as dicts (the TOML shape) or :class:`Rule` objects; ``registry`` knows
        the plug-in ops a rule may name (default: the process's)."""
        built = []
        for i, r in enumerate(rules, 1):
            if not isinstance(r, Rule):
                r = rule_from_dict(r, f"rule {i} ({name})", registry=registry)
            built.append(r)
        return cls(built, name)

    @classmethod
    def from_toml(
        cls, text: str, name: str = "<toml>", *, registry: Registry | None = None
    ) -> Policy:
        """``[[rule]]`` tables; see the module docstring for the keys."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise PolicyError(f"{name}: not valid TOML: {e}") from None
        unknown = set(data) - {"rule"}
        if unknown:
            raise PolicyError(
                f"{name}: unknown top-level key(s) {sorted(unknown)}; a policy file holds "
                f"[[rule]] tables only."
            )
        raw_rules = data.get("rule", [])
        if not isinstance(raw_rules, list):
            raise PolicyError(f"{name}: write rules as [[rule]] tables, not [rule]")
        lines = header_lines(text)
        if len(lines) != len(raw_rules):  # rule = [...] written inline: no header to point at
            lines = []
        rules = []
        for i, r in enumerate(raw_rules):
            line = f", line {lines[i]}" if lines else ""
            rules.append(rule_from_dict(r, f"rule {i + 1} ({name}{line})", registry=registry))
        return cls(rules, name)

    @classmethod
    def from_format(
        cls,
        form: str,
        text: str,
        name: str = "<policy>",
        *,
        registry: Registry | None = None,
        **options: Any,
    ) -> Policy:
        """Rules in a format a plug-in registered (``"quant.mesa"``: Mesa's policy text), read
        by that plug-in (see :meth:`~torchstash.registry.Registry.register_policy_format`)."""
        reg = resolved(registry)
        reader = reg.policy_format(form)
        return cls.from_rules(reader.read(text, name, **options), name, registry=reg)

    @classmethod
    def from_mesa(cls, text: str, name: str = "<mesa>", strategy: str = "quant.mesa") -> Policy:
        """Mesa's policy text: ``from_format("quant.mesa", ...)``, read by torchstash-quant."""
        return cls.from_format("quant.mesa", text, name, strategy=strategy)

    @classmethod
    def load(
        cls, path: str | Path, form: str | None = None, *, registry: Registry | None = None
    ) -> Policy:
        """A policy file: TOML (``.toml``), or a format a plug-in reads (``form``, else the
        one claiming the file's suffix: Mesa's text format, from torchstash-quant)."""
        p = Path(path)
        try:
            data = p.read_bytes()
        except OSError as e:
            raise PolicyError(f"cannot read policy file {str(p)!r}: {e}") from None
        try:
            text = data.decode("utf-8-sig")  # TOML is UTF-8 whatever the locale; a BOM is fine
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise PolicyError(
                f"policy file {str(p)!r} is not UTF-8 text: byte {data[e.start]:#04x} on line "
                f"{line} ({e.reason}). Save it as UTF-8."
            ) from None
        reg = resolved(registry)
        if form is None and p.suffix == ".toml":
            return cls.from_toml(text, p.name, registry=reg)
        if form is None:
            found = reg.policy_format_for(p.suffix)
            if found is None:
                raise PolicyError(
                    f"policy file {str(p)!r}: no installed plug-in reads {p.suffix or 'suffix-less'} "
                    f"files. Write the policy as TOML (.toml), or install the plug-in whose "
                    f"format it is (Mesa's text format: pip install torchstash-quant)."
                )
            form = found.name
        if form == "toml":
            return cls.from_toml(text, p.name, registry=reg)
        return cls.from_format(form, text, p.name, registry=reg)


#: how a command line spells a boolean option
_BOOLEANS = {"true": True, "false": False}


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"quant.auto:budget=3;floor=2"`` -> ``("quant.auto", {"budget": 3, "floor": 2})``.

    The command-line form of a strategy with options; values are Python literals where they
    parse as one (``true`` and ``false`` in any case are booleans, as a shell user or a TOML
    file writes them), strings otherwise.
    """
    name, _, rest = spec.partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, rest.split(";")):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise PolicyError(
                f"strategy {spec!r}: write options as name:key=value;key=value, got {item!r}"
            )
        text = value.strip()
        if text.lower() in _BOOLEANS:
            options[key.strip()] = _BOOLEANS[text.lower()]
            continue
        try:
            options[key.strip()] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key.strip()] = text
    if not name.strip():
        raise PolicyError(f"strategy {spec!r}: the strategy name is missing before ':'")
    return name.strip(), options


def as_policy(
    policy: Policy | str | Path | Sequence[Mapping[str, Any] | Rule],
    *,
    registry: Registry | None = None,
) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, Path)):
        return Policy.load(policy, registry=registry)
    return Policy.from_rules(policy, registry=registry)


def rule_from_dict(
    raw: Mapping[str, Any], source: str, *, registry: Registry | None = None
) -> Rule:
    """Validate one rule's keys and values; every error names ``source``."""
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{source}: a rule is a table of keys, got {raw!r}")
    unknown = set(raw) - set(RULE_KEYS)
    if unknown:
        hint = _did_you_mean(sorted(unknown)[0], RULE_KEYS)
        raise PolicyError(
            f"{source}: unknown key(s) {sorted(unknown)}{hint}. Valid keys: {', '.join(RULE_KEYS)}."
        )
    strategy = raw.get("strategy", "none")
    if not isinstance(strategy, str) or not strategy:
        raise PolicyError(f"{source}: 'strategy' must be a strategy name such as 'quant.int8'")
    if raw.get("enable", True) is False:
        strategy = "none"
    elif not isinstance(raw.get("enable", True), bool):
        raise PolicyError(f"{source}: 'enable' must be true or false")
    options = raw.get("options", {})
    if not isinstance(options, Mapping):
        raise PolicyError(f"{source}: 'options' must be a table, got {options!r}")
    if strategy == "none" and options:
        raise PolicyError(f"{source}: strategy 'none' takes no options, got {dict(options)}")
    kw: dict[str, Any] = {}
    for key in ("type", "tag"):
        if key in raw:
            kw[key] = _type_name(raw[key], key, source)
    for key in ("module", "role"):
        if key in raw:
            if not isinstance(raw[key], str) or not raw[key]:
                raise PolicyError(f"{source}: {key!r} must be a non-empty string")
            kw[key] = raw[key]
    if "op" in raw:
        op = raw["op"]
        if not isinstance(op, str) or not (is_known_op(op) or _plugin_op(op, registry)):
            raise PolicyError(
                f"{source}: unknown op {op!r}. Use an op name such as "
                f"linear, matmul, softmax, gelu, layer_norm, conv, scaled_dot_product_attention."
            )
        kw["op"] = op
    for key, needs in (("index", "type"), ("op_index", "op")):
        if key in raw:
            if needs not in raw:
                raise PolicyError(f"{source}: {key!r} needs {needs!r} (indices count {needs}s)")
            kw[key] = _indices(raw[key], key, source)
    return Rule(strategy=strategy, options=dict(options), source=source, **kw)


def _plugin_op(name: str, registry: Registry | None) -> bool:
    """A plug-in's own op with a default code (``memsave.relu``), which a rule may override."""
    return "." in name and resolved(registry).op_default(name) is not None


def _type_name(value: Any, key: str, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PolicyError(f"{source}: {key!r} must be a module type tag or class name")
    return tags.normalize(value)


def _indices(value: Any, key: str, source: str) -> frozenset[int] | None:
    if value == "all":
        return None
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
    ):
        raise PolicyError(f"{source}: {key!r} must be 'all', an index >= 0 or a list of them")
    return frozenset(items)


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
