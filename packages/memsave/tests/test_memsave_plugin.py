"""The plug-in installs on its own beside the core and is discovered by its entry point."""

from __future__ import annotations

import importlib.metadata as metadata

import torchstash
import torchstash_memsave


def test_entry_point_declared() -> None:
    eps = [ep for ep in metadata.entry_points(group="torchstash.plugins") if ep.name == "memsave"]
    assert len(eps) == 1, eps
    assert eps[0].load() is torchstash_memsave.register


def test_discovered_and_loaded() -> None:
    records = {r.prefix: r for r in torchstash.REGISTRY.plugins()}
    assert "memsave" in records, sorted(records)
    record = records["memsave"]
    assert record.loaded and record.error is None
    assert record.distribution == "torchstash-memsave"
    assert record.version == torchstash_memsave.__version__


def test_strategies_only_under_own_prefix() -> None:
    for s in torchstash.REGISTRY.strategies():
        if s.distribution == "torchstash-memsave":
            assert s.name == "memsave" or s.name.startswith("memsave."), s.name
