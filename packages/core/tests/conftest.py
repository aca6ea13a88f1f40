"""Fixtures for the core's tests: temporary toy strategies, and the compiled kernels' state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import torchstash
from torchstash import env
from torchstash.kernels import loader
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


# -- compiled kernels -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env.KERNELS, "auto")
        info = loader.status()
    if not info["built"]:
        pytest.skip("compiled kernels unavailable: " + "; ".join(info["reasons"]))


@pytest.fixture
def kernels_on(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels are built and the mode is ``auto`` whatever the environment says."""
    monkeypatch.setenv(env.KERNELS, "auto")


@pytest.fixture
def kernel(kernels_on: None, device: torch.device) -> Iterator[None]:
    """As ``kernels_on``, and the kernels serve ``device``."""
    if not loader.available(device):
        pytest.skip(f"kernels built without {device.type} support")
    yield
