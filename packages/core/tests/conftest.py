"""Fixtures for the core's tests: temporary strategies built from the shipped toy compressors."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import torchstash
from torchstash.testing.toys import CloneCompressor, HalfCompressor


@pytest.fixture
def toy_strategies() -> Iterator[list[str]]:
    """Registers ``test.clone`` (lossless) and ``test.half`` (lossy) for one test."""
    reg = torchstash.REGISTRY
    reg.register("test.clone", CloneCompressor, lossless=True, summary="copy")
    reg.register("test.half", HalfCompressor, lossless=False, summary="bf16")
    try:
        yield ["test.clone", "test.half"]
    finally:
        reg.unregister("test.clone")
        reg.unregister("test.half")
