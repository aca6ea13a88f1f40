"""Checks every plug-in's own tests make: it is installed, discovered, loaded, and polite."""

from __future__ import annotations

import importlib.metadata as metadata
from types import ModuleType

from ..registry import GROUP, REGISTRY


def assert_plugin_installed(prefix: str, distribution: str, module: ModuleType) -> None:
    """The entry point ``prefix`` of ``distribution`` loads ``module.register``; the registry
    loaded it without error; every strategy it registered lies under its prefix."""
    eps = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == prefix]
    assert len(eps) == 1, f"expected one {GROUP!r} entry point named {prefix!r}, got {eps}"
    assert eps[0].load() is module.register
    records = {r.prefix: r for r in REGISTRY.plugins()}
    assert prefix in records, f"{distribution} not discovered; found {sorted(records)}"
    record = records[prefix]
    assert record.loaded and record.error is None, record.error
    assert record.distribution == distribution
    assert record.version == module.__version__
    for s in REGISTRY.strategies():
        if s.distribution == distribution:
            assert s.name == prefix or s.name.startswith(prefix + "."), s.name
