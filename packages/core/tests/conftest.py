"""Fixtures for the core's tests: temporary toy strategies, and the compiled kernels' state."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import torchstash
from torchstash import env
from torchstash.kernels import loader
from torchstash.testing.toys import (
    CloneCompressor,
    DerivableClone,
    DerivableHalf,
    HalfCompressor,
)


@pytest.fixture
def toy_strategies() -> Iterator[list[str]]:
    """Registers ``test.clone`` (lossless) and ``test.half`` (lossy) for one test, and their
    derivable variants ``test.derive`` and ``test.derive_half`` (see :mod:`torchstash.derive`)."""
    reg = torchstash.REGISTRY
    toys = {
        "test.clone": (CloneCompressor, True),
        "test.half": (HalfCompressor, False),
        "test.derive": (DerivableClone, True),
        "test.derive_half": (DerivableHalf, False),
    }
    for name, (factory, lossless) in toys.items():
        reg.register(name, factory, lossless=lossless, summary=factory.__doc__ or name)
    try:
        yield ["test.clone", "test.half"]
    finally:
        for name in toys:
            reg.unregister(name)


# -- compiled kernels -------------------------------------------------------------------------


def _unavailable(reason: str) -> None:
    """Skips, unless ``TORCHSTASH_KERNELS=require`` (a GPU check): then a kernel that did not
    build, or was built without the device, fails the test instead of passing as a skip."""
    if env.get(env.KERNELS, "").lower() == "require":
        pytest.fail(f"{env.KERNELS}=require, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def built() -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env.KERNELS, "auto")
        info = loader.status()
    if not info["built"]:
        _unavailable("compiled kernels unavailable: " + "; ".join(info["reasons"]))


@pytest.fixture
def kernels_on(built: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels are built and the mode is ``auto`` whatever the environment says."""
    monkeypatch.setenv(env.KERNELS, "auto")


@pytest.fixture
def kernel(kernels_on: None, device: torch.device) -> Iterator[None]:
    """As ``kernels_on``, and the kernels serve ``device``."""
    if not loader.available(device):
        _unavailable(f"kernels built without {device.type} support")
    yield
