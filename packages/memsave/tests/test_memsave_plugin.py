"""The plug-in installs on its own beside the core and is discovered by its entry point."""

from __future__ import annotations

import torchstash_memsave
from torchstash.testing.plugins import assert_plugin_installed


def test_installed_and_discovered() -> None:
    assert_plugin_installed("memsave", "torchstash-memsave", torchstash_memsave)
