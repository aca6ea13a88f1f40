"""Registry: strict registration, lazy discovery through (fake) entry points, broken plug-ins."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

import torchstash
from torchstash.errors import (
    DuplicateStrategyError,
    OptionError,
    PluginLoadError,
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


def test_lazy_loading_by_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    a = plugin_module(
        monkeypatch, "fake_a", lambda r: r.register("a.x", _factory, lossless=True, summary="x")
    )
    b = plugin_module(
        monkeypatch, "fake_b", lambda r: r.register("b", _factory, lossless=True, summary="b")
    )
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
    plugin_module(
        monkeypatch,
        "fake_c",
        lambda r: r.register("offload.cpu", _factory, lossless=True, summary=""),
    )
    reg = Registry(
        discover=lambda: [],
        builtins=lambda r: r.register("offload.cpu", _factory, lossless=True, summary="core"),
    )
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
    plugin_module(
        monkeypatch, "fake_ok", lambda r: r.register("ok", _factory, lossless=True, summary="")
    )
    reg = registry_with(
        monkeypatch,
        FakeDist("torchstash-broken", "0.3", {"broken": "fake_broken:register"}),
        FakeDist("torchstash-ok", "1", {"ok": "fake_ok:register"}),
    )
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
    plugin_module(
        monkeypatch,
        "fake_e",
        lambda r: r.register("quant.int8", _factory, lossless=False, summary=""),
    )
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
    calls = plugin_module(
        monkeypatch, "fake_f", lambda r: r.register("f.x", _factory, lossless=True, summary="")
    )
    reg = registry_with(monkeypatch, FakeDist("torchstash-f", "1", {"f": "fake_f:register"}))
    monkeypatch.setenv("TORCHSTASH_DISABLE_PLUGINS", value)
    with pytest.raises(UnknownStrategyError, match="TORCHSTASH_DISABLE_PLUGINS"):
        reg.get("f.x")
    assert calls == []
    assert [r.disabled for r in reg.plugins()] == [True]


def test_unknown_name_lists_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry(
        discover=lambda: [],
        builtins=lambda r: r.register("none", _factory, lossless=True, summary=""),
    )
    with pytest.raises(UnknownStrategyError) as e:
        reg.get("quant.int3")
    assert "Installed: none" in str(e.value) and "torchstash-quant" in str(e.value)


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
    def factory(bits: int = 8, group: int = 256) -> None:
        return None

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
