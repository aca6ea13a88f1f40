"""The plug-in installs on its own beside the core and is discovered by its entry point."""

from __future__ import annotations

import importlib.metadata as metadata

import torchstash
import torchstash_quant


def test_entry_point_declared() -> None:
    eps = [ep for ep in metadata.entry_points(group="torchstash.plugins") if ep.name == "quant"]
    assert len(eps) == 1, eps
    assert eps[0].load() is torchstash_quant.register


def test_discovered_and_loaded() -> None:
    records = {r.prefix: r for r in torchstash.REGISTRY.plugins()}
    assert "quant" in records, sorted(records)
    record = records["quant"]
    assert record.loaded and record.error is None
    assert record.distribution == "torchstash-quant"
    assert record.version == torchstash_quant.__version__


def test_strategies_only_under_own_prefix() -> None:
    for s in torchstash.REGISTRY.strategies():
        if s.distribution == "torchstash-quant":
            assert s.name == "quant" or s.name.startswith("quant."), s.name
