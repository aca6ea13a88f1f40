"""Registry: strict registration, lazy discovery through (fake) entry points, broken plug-ins."""

from __future__ import annotations

import dataclasses
import importlib.metadata as metadata
import re
import sys
import types
from collections.abc import Callable
from typing import Any, Literal

import pytest

import torchstash
from torchstash.declare import StrategyTable, configured
from torchstash.errors import (
    DuplicateStrategyError,
    OptionError,
    PluginLoadError,
    PolicyError,
    RegistryError,
    UnknownStrategyError,
)
from torchstash.registry import GROUP, Registry


class FakeDist:
    """Enough of importlib.metadata.Distribution for discovery (the pluggy way)."""

    def __init__(self, name: str, version: str, eps: dict[str, str]) -> None:
        self.metadata = {"Name": name}
        self.version = version
        self.entry_points = [metadata.EntryPoint(n, v, GROUP) for n, v in eps.items()]


def plugin_module(
    monkeypatch: pytest.MonkeyPatch, modname: str, register: Callable[[Any], None]
) -> list[int]:
    """Install a fake plug-in module whose ``register`` counts its calls."""
    calls: list[int] = []
    mod = types.ModuleType(modname)

    def reg(registry: Any) -> None:
        calls.append(1)
        register(registry)

    mod.register = reg  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, modname, mod)
    return calls


def registry_with(monkeypatch: pytest.MonkeyPatch, *dists: FakeDist) -> Registry:
    monkeypatch.setattr(metadata, "distributions", lambda: list(dists))
    return Registry()


def _factory() -> None:
    return None


def registers(
    name: str, factory: Callable[..., Any] = _factory, *, lossless: bool = True, summary: str = ""
) -> Callable[[Any], None]:
    """A ``register(registry)`` (a plug-in's, or the builtins') that registers ``name`` alone."""
    return lambda r: r.register(name, factory, lossless=lossless, summary=summary)


def registry_with_ok(monkeypatch: pytest.MonkeyPatch, failing: FakeDist) -> Registry:
    """A registry that discovers ``failing`` and, beside it, ``ok`` from ``torchstash-ok 1``, a
    plug-in that loads: what ``failing`` must not take down with it."""
    plugin_module(monkeypatch, "fake_ok", registers("ok"))
    ok = FakeDist("torchstash-ok", "1", {"ok": "fake_ok:register"})
    return registry_with(monkeypatch, failing, ok)


def test_lazy_loading_by_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    a = plugin_module(monkeypatch, "fake_a", registers("a.x", summary="x"))
    b = plugin_module(monkeypatch, "fake_b", registers("b", summary="b"))
    reg = registry_with(
        monkeypatch,
        FakeDist("torchstash-a", "1.0", {"a": "fake_a:register"}),
        FakeDist("torchstash-b", "2.0", {"b": "fake_b:register"}),
    )
    s = reg.get("a.x")
    assert (s.distribution, s.version) == ("torchstash-a", "1.0")
    assert a == [1] and b == []  # b not imported until asked for
    assert reg.get("b").distribution == "torchstash-b"
    reg.get("a.x")
    assert a == [1] and b == [1]  # loaded once


def test_same_name_from_two_distributions_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module(monkeypatch, "fake_c", registers("offload.cpu"))
    reg = Registry(discover=lambda: [], builtins=registers("offload.cpu", summary="core"))
    reg2 = registry_with(
        monkeypatch, FakeDist("torchstash-evil", "0.1", {"offload": "fake_c:register"})
    )
    reg2._builtins = reg._builtins
    with pytest.raises(DuplicateStrategyError) as e:
        reg2.get("offload.cpu")
    msg = str(e.value)
    assert "torchstash 0.1.0" in msg and "torchstash-evil 0.1" in msg


def test_prefix_claimed_twice_names_both(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module(monkeypatch, "fake_d", lambda r: None)
    reg = registry_with(
        monkeypatch,
        FakeDist("dist-one", "1", {"q": "fake_d:register"}),
        FakeDist("dist-two", "2", {"q": "fake_d:register"}),
    )
    with pytest.raises(DuplicateStrategyError, match=r"(?s)dist-one 1.*dist-two 2"):
        reg.get("q.int8")


def test_broken_plugin_breaks_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(r: Any) -> None:
        raise ImportError("libfoo.so: cannot open shared object file")

    plugin_module(monkeypatch, "fake_broken", boom)
    broken = FakeDist("torchstash-broken", "0.3", {"broken": "fake_broken:register"})
    reg = registry_with_ok(monkeypatch, broken)
    with pytest.raises(PluginLoadError) as e:
        reg.get("broken.fast")
    assert "torchstash-broken 0.3" in str(e.value) and "torchstash doctor" in str(e.value)
    assert isinstance(e.value.__cause__, ImportError)
    assert reg.get("ok").name == "ok"
    records = {r.prefix: r for r in reg.plugins()}
    assert records["broken"].error is not None and not records["broken"].loaded
    assert records["ok"].loaded


def test_missing_module_is_a_load_error(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = registry_with(
        monkeypatch, FakeDist("torchstash-gone", "1", {"gone": "no_such_module_xyz:register"})
    )
    with pytest.raises(PluginLoadError) as e:
        reg.get("gone.x")
    assert isinstance(e.value.__cause__, ModuleNotFoundError)


def test_plugin_must_stay_under_its_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module(monkeypatch, "fake_e", registers("quant.int8", lossless=False))
    reg = registry_with(monkeypatch, FakeDist("torchstash-e", "1", {"e": "fake_e:register"}))
    with pytest.raises(PluginLoadError) as e:
        reg.get("e.x")
    assert "own prefix" in str(e.value.__cause__)


def test_failed_plugin_rolls_back_partial_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    def half(r: Any) -> None:
        r.register("h.one", _factory, lossless=True, summary="")
        raise RuntimeError("second half failed")

    plugin_module(monkeypatch, "fake_h", half)
    reg = registry_with(monkeypatch, FakeDist("torchstash-h", "1", {"h": "fake_h:register"}))
    with pytest.raises(PluginLoadError):
        reg.get("h.one")
    assert "h.one" not in reg.names()


@pytest.mark.parametrize("value", ["f", "torchstash-f", "*", "other, F"])
def test_disable_plugins(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    calls = plugin_module(monkeypatch, "fake_f", registers("f.x"))
    reg = registry_with(monkeypatch, FakeDist("torchstash-f", "1", {"f": "fake_f:register"}))
    monkeypatch.setenv("TORCHSTASH_DISABLE_PLUGINS", value)
    with pytest.raises(UnknownStrategyError, match="TORCHSTASH_DISABLE_PLUGINS"):
        reg.get("f.x")
    assert calls == []
    assert [r.disabled for r in reg.plugins()] == [True]


def test_unknown_name_suggests_the_closest_and_installs_only_what_exists() -> None:
    """A typo gets the closest installed names; an install is proposed only for a plug-in of
    this project's that is missing, never ``pip install torchstash-<typo>``."""
    reg = Registry(discover=lambda: [], builtins=registers("none"))
    with pytest.raises(UnknownStrategyError) as e:
        reg.get("quant.int3")  # torchstash-quant is not installed here
    assert "pip install torchstash-quant" in str(e.value)
    with pytest.raises(UnknownStrategyError) as e:
        reg.get("nnone")
    assert "did you mean 'none'?" in str(e.value) and "pip install" not in str(e.value)
    with pytest.raises(UnknownStrategyError) as e:
        reg.get("qaunt.int2")
    assert "pip install" not in str(e.value) and "Installed: none" in str(e.value)


def test_unknown_variant_of_an_installed_plugin_names_its_strategies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def register(r: Any) -> None:
        for n in ("f.int4", "f.int8"):
            r.register(n, _factory, lossless=True, summary="")

    plugin_module(monkeypatch, "fake_f2", register)
    reg = registry_with(monkeypatch, FakeDist("torchstash-f", "1", {"f": "fake_f2:register"}))
    with pytest.raises(UnknownStrategyError) as e:
        reg.get("f.int3")
    text = str(e.value)
    assert (
        "did you mean 'f.int4' or 'f.int8'?" in text or "did you mean 'f.int8' or 'f.int4'?" in text
    )
    assert "offers: f.int4, f.int8" in text and "pip install" not in text


def test_in_process_duplicate_names_both_sides() -> None:
    reg = Registry(discover=lambda: [])
    reg.register("mine", _factory, lossless=True, summary="")
    with pytest.raises(DuplicateStrategyError, match=r"(?s)<in-process>.*<in-process>"):
        reg.register("mine", _factory, lossless=True, summary="")


@pytest.mark.parametrize("name", ["", " x", "a>b", "a b", "a,b"])
def test_bad_names_rejected(name: str) -> None:
    with pytest.raises(RegistryError):
        Registry(discover=lambda: []).register(name, _factory, lossless=True, summary="")


def test_options_are_validated() -> None:
    def factory(bits: int = 8, group: int = 256) -> object:
        return torchstash.AS_IS

    reg = Registry(discover=lambda: [])
    s = reg.register("opt", factory, lossless=False, summary="")
    assert s.options() == ["bits", "group"]
    s.create(bits=4)
    with pytest.raises(OptionError, match="It accepts: bits, group"):
        s.create(bitz=4)


def test_core_builtins_through_the_same_path() -> None:
    by_name = {s["name"]: s for s in torchstash.strategies()}
    assert by_name["none"]["distribution"] == "torchstash"
    assert by_name["none"]["lossless"] is True
    assert by_name["offload.cpu"]["options"] == ["prefetch", "pin_memory"]
    assert by_name["offload.cpu"]["version"] == torchstash.__version__


# -- clashes, failing plug-ins, strict factories -----------------------------------------------


def _evil_none() -> str:
    return "the plug-in's none"


def test_plugin_registering_none_keeps_the_builtin(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module(monkeypatch, "fake_none", registers("none", _evil_none, summary="evil"))
    reg = registry_with(
        monkeypatch, FakeDist("torchstash-evil", "6.6", {"none": "fake_none:register"})
    )
    reg._builtins = registers("none", summary="core")
    for _ in range(2):  # every time, not only the first: never the plug-in's, never silently
        with pytest.raises(DuplicateStrategyError, match=r"(?s)'none'.*torchstash 0.1.0.*evil 6.6"):
            reg.get("none")
    assert [(s.name, s.distribution) for s in reg.strategies()] == [("none", "torchstash")]
    (record,) = reg.plugins()
    assert isinstance(record.error, DuplicateStrategyError) and not record.loaded


def test_prefix_claimed_twice_is_recorded_not_raised_by_listing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin_module(monkeypatch, "fake_q", lambda r: None)
    reg = registry_with(
        monkeypatch,
        FakeDist("dist-one", "1", {"q": "fake_q:register"}),
        FakeDist("dist-two", "2", {"q": "fake_q:register"}),
    )
    (record,) = reg.plugins()  # listing loads everything and does not raise
    assert isinstance(record.error, DuplicateStrategyError)
    assert (record.distribution, record.version) == ("dist-one and dist-two", "1 and 2")
    for _ in range(2):
        with pytest.raises(DuplicateStrategyError, match=r"(?s)dist-one 1.*dist-two 2"):
            reg.get("q.int8")


class _Abort(BaseException):
    """A plug-in's own BaseException (not an Exception)."""


@pytest.mark.parametrize("error", [SystemExit(3), _Abort("stop"), GeneratorExit(), ValueError()])
def test_plugin_raising_anything_is_isolated_and_rolled_back(
    monkeypatch: pytest.MonkeyPatch, error: BaseException
) -> None:
    def half(r: Any) -> None:
        r.register("h.one", _factory, lossless=True, summary="")
        raise error

    plugin_module(monkeypatch, "fake_half", half)
    reg = registry_with_ok(monkeypatch, FakeDist("torchstash-h", "1", {"h": "fake_half:register"}))
    with pytest.raises(PluginLoadError, match="torchstash-h 1") as e:
        reg.get("h.one")
    assert e.value.__cause__ is error
    assert reg.names() == ["ok"]  # nothing of h's stays visible; ok loads
    with pytest.raises(PluginLoadError):
        reg.get("h.one")


def test_keyboard_interrupt_propagates_rolled_back(monkeypatch: pytest.MonkeyPatch) -> None:
    interrupt = [True]

    def half(r: Any) -> None:
        r.register("k.one", _factory, lossless=True, summary="")
        if interrupt.pop():
            raise KeyboardInterrupt

    calls = plugin_module(monkeypatch, "fake_k", half)
    reg = registry_with(monkeypatch, FakeDist("torchstash-k", "1", {"k": "fake_k:register"}))
    with pytest.raises(KeyboardInterrupt):
        reg.get("k.one")
    assert "k.one" not in reg._strategies and "k" not in reg._plugins
    interrupt.append(False)
    assert reg.get("k.one").distribution == "torchstash-k"  # the next request loads it again
    assert calls == [1, 1]


def test_failed_plugin_keeps_a_plugin_it_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    def outer(r: Any) -> None:
        r.get("inner.x")
        r.register("outer.x", _factory, lossless=True, summary="")
        raise RuntimeError("outer breaks after loading inner")

    plugin_module(monkeypatch, "fake_outer", outer)
    plugin_module(monkeypatch, "fake_inner", registers("inner.x"))
    reg = registry_with(
        monkeypatch,
        FakeDist("torchstash-outer", "1", {"outer": "fake_outer:register"}),
        FakeDist("torchstash-inner", "1", {"inner": "fake_inner:register"}),
    )
    with pytest.raises(PluginLoadError):
        reg.get("outer.x")
    assert reg.names() == ["inner.x"]
    assert {r.prefix: r.loaded for r in reg.plugins()} == {"inner": True, "outer": False}


def test_plugin_may_not_unregister_others(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin_module(monkeypatch, "fake_u", lambda r: r.unregister("none"))
    reg = registry_with(monkeypatch, FakeDist("torchstash-u", "1", {"u": "fake_u:register"}))
    reg._builtins = registers("none", summary="core")
    with pytest.raises(PluginLoadError) as e:
        reg.get("u.x")
    assert "may only unregister names under its own prefix" in str(e.value.__cause__)
    assert reg.get("none").distribution == "torchstash"


def test_in_process_register_of_a_core_name_fails_at_once() -> None:
    reg = Registry(discover=lambda: [], builtins=registers("none", summary="core"))
    with pytest.raises(DuplicateStrategyError, match=r"(?s)torchstash 0.1.0.*<in-process>"):
        reg.register("none", _evil_none, lossless=True, summary="mine")
    assert reg.get("none").distribution == "torchstash"


def test_factory_returning_none_names_strategy_and_distribution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def forgot_return() -> None:
        pass

    plugin_module(monkeypatch, "fake_n", registers("n.codec", forgot_return))
    reg = registry_with(monkeypatch, FakeDist("torchstash-n", "2.1", {"n": "fake_n:register"}))
    with pytest.raises(RegistryError, match=r"'n.codec' from torchstash-n 2.1: .*returned None"):
        reg.get("n.codec").create()
    assert torchstash.REGISTRY.get("none").create() is None  # AS_IS: stored as is


def test_option_values_checked_against_annotations() -> None:
    def factory(
        stochastic: bool = True,
        seed: int | None = None,
        budget: float = 2.0,
        bits: tuple[int, ...] = (2, 4),
        mode: Literal["fast", "exact"] = "fast",
        level: int | str | None = "auto",
        other: object = None,
    ) -> object:
        return torchstash.AS_IS

    s = Registry(discover=lambda: []).register("typed", factory, lossless=True, summary="")
    s.create(stochastic=False, seed=3, budget=3, bits=[2, 8], mode="exact", level="x", other=[])
    s.create(seed=None, level=None)
    for key, value, message in [
        ("stochastic", "no", "True or False"),
        ("stochastic", 1, "True or False"),
        ("seed", "abc", "an integer or None"),
        ("seed", 1.5, "an integer or None"),
        ("seed", True, "an integer or None"),
        ("budget", "2", "a number"),
        ("bits", (2, "4"), "a tuple whose items are each an integer"),
        ("mode", "slow", "'fast' or 'exact'"),
    ]:
        with pytest.raises(
            OptionError, match=rf"'typed': option {key}={re.escape(repr(value))} must be {message}"
        ):
            s.create(**{key: value})


# -- one registry, passed through ---------------------------------------------------------------


def _own_registry() -> Registry:
    from torchstash.testing.toys import HalfCompressor

    reg = Registry.fresh(plugins=False)
    reg.register("mine.half", HalfCompressor, lossless=False, summary="bf16 copies")
    return reg


def test_apply_stash_and_strategies_take_a_registry_and_leave_the_process_one_alone() -> None:
    import torch
    from torch import nn

    import torchstash as ts
    from torchstash.registry import REGISTRY

    reg = _own_registry()
    generation = REGISTRY.generation
    assert "mine.half" in {s["name"] for s in ts.strategies(registry=reg)}
    assert "mine.half" not in {s["name"] for s in ts.strategies()}
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    with pytest.raises(UnknownStrategyError):
        ts.apply(model, "mine.half")
    with ts.apply(model, "mine.half", registry=reg, min_bytes=0) as handle:
        model(x).sum().backward()
        assert handle.plan.registry is reg
        assert handle.tally.stored_bytes < handle.tally.raw_bytes  # it ran: bf16 copies
    with ts.stash("mine.half", registry=reg, min_bytes=0) as block:
        model(x).sum().backward()
    assert block.plan.registry is reg and block.tally.stored_bytes < block.tally.raw_bytes
    assert REGISTRY.generation == generation and "mine.half" not in REGISTRY.names()


def test_a_policy_names_a_plugin_op_of_the_registry_it_is_read_with() -> None:
    from torchstash.policy import Policy
    from torchstash.testing.toys import HalfCompressor

    reg = _own_registry()
    reg.register_op_default("mine.square", HalfCompressor, summary="a plug-in op's code")
    rules = [{"op": "mine.square", "strategy": "none"}]
    assert Policy.from_rules(rules, registry=reg).rules[0].op == "mine.square"
    with pytest.raises(PolicyError, match="unknown op 'mine.square'"):
        Policy.from_rules(rules)  # the process's registry knows no such op


def test_a_compressor_error_names_the_distribution_from_the_plans_registry() -> None:
    import torch
    from torch import nn

    import torchstash as ts
    from torchstash.errors import CompressionError
    from torchstash.testing.toys import HalfCompressor

    class Broken(HalfCompressor):
        def compress(self, x: torch.Tensor, site: ts.Site) -> ts.Packed:
            raise RuntimeError("broken on purpose")

    reg = Registry.fresh(plugins=False)
    reg.register("mine.broken", Broken, lossless=False, summary="raises")
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU())
    with (
        ts.apply(model, "mine.broken", registry=reg, min_bytes=0),
        pytest.raises(CompressionError, match="strategy 'mine.broken'"),
    ):
        model(torch.randn(8, 64, requires_grad=True))


def test_a_strategy_table_registers_what_it_declares_in_order() -> None:
    """``torchstash.declare``: each decorated factory is registered as declared (the
    factory itself stays callable), and a clash is the registry's error, naming the name."""
    from torchstash.declare import StrategyTable

    table = StrategyTable()

    @table.strategy("t.first", lossless=True, summary="first", candidate=True)
    def first() -> object:
        return torchstash.AS_IS

    table.strategy("t.second", lossless=False, summary="second", preset=True)(lambda: None)
    registry = Registry.fresh()
    table.register(registry)
    got = registry.get("t.first")
    assert (got.factory, got.lossless, got.candidate) == (first, True, True)
    assert registry.get("t.second").preset and not registry.get("t.second").lossless
    assert [d.name for d in table.declared] == ["t.first", "t.second"]
    assert first() is torchstash.AS_IS
    with pytest.raises(RegistryError, match="t.first"):
        table.register(registry)


def test_a_strategy_table_takes_the_summary_from_the_docstring() -> None:
    from torchstash.declare import StrategyTable

    table = StrategyTable()

    @table.strategy("t.doc", lossless=True)
    def documented() -> object:
        """Keeps what it is given.

        More words that the summary leaves out."""
        return torchstash.AS_IS

    assert table.declared[0].summary == "Keeps what it is given"
    with pytest.raises(TypeError, match="'t.bare': give summary= or a docstring"):
        table.strategy("t.bare", lossless=True)(lambda: None)


@dataclasses.dataclass(frozen=True)
class _TopkConfig:
    """Keep the k largest magnitudes.

    More text, not in the summary."""

    k: int = 4
    exact: bool = False
    mode: Literal["fast", "exact"] = "fast"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise OptionError(f"topk: option k={self.k!r} must be at least 1")


def test_a_config_type_and_its_handler_make_a_strategy() -> None:
    """:func:`torchstash.declare.configured`: the config's fields are the strategy's options
    (listed, checked against their string annotations in the config's module, positional
    ones too), its docstring the summary, its own checks run, and the handler builds."""
    built: list[_TopkConfig] = []

    def build(config: _TopkConfig) -> object:
        built.append(config)
        return torchstash.AS_IS

    table = StrategyTable()
    table.strategy("topk", lossless=False)(configured(_TopkConfig, build))
    reg = Registry(discover=lambda: [])
    table.register(reg)
    s = reg.get("topk")
    assert s.options() == ["k", "exact", "mode"]
    assert s.summary == "Keep the k largest magnitudes"
    s.create(k=2, mode="exact")
    assert built == [_TopkConfig(2, False, "exact")]
    with pytest.raises(OptionError, match=r"'topk': option exact='yes' must be True or False"):
        s.create(exact="yes")
    with pytest.raises(OptionError, match=r"'topk': option mode='slow' must be 'fast' or 'exact'"):
        s.create(mode="slow")
    with pytest.raises(OptionError, match=r"topk: option k=0 must be at least 1"):
        s.create(k=0)
    with pytest.raises(OptionError, match="It accepts: k, exact, mode"):
        s.create(kk=1)
