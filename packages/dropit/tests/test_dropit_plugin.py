"""The plug-in installs on its own beside the core and is discovered by its entry point."""

from __future__ import annotations

import importlib.metadata as metadata

import torchstash
import torchstash_dropit


def test_entry_point_declared() -> None:
    eps = [ep for ep in metadata.entry_points(group="torchstash.plugins") if ep.name == "dropit"]
    assert len(eps) == 1, eps
    assert eps[0].load() is torchstash_dropit.register


def test_discovered_and_loaded() -> None:
    records = {r.prefix: r for r in torchstash.REGISTRY.plugins()}
    assert "dropit" in records, sorted(records)
    record = records["dropit"]
    assert record.loaded and record.error is None
    assert record.distribution == "torchstash-dropit"
    assert record.version == torchstash_dropit.__version__


def test_strategies_only_under_own_prefix() -> None:
    for s in torchstash.REGISTRY.strategies():
        if s.distribution == "torchstash-dropit":
            assert s.name == "dropit" or s.name.startswith("dropit."), s.name
