"""The strategies the core ships: ``none`` and ``offload.cpu``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .compressor import AS_IS
from .offload import CpuOffload


class Registering(Protocol):
    """What :func:`register` needs of a registry (the registry calls it: no import back)."""

    def register(
        self, name: str, factory: Callable[..., Any], *, lossless: bool, summary: str
    ) -> object: ...


def _none() -> object:
    """Stores every saved tensor as it is (and counts it): the baseline for measurement."""
    return AS_IS


def _offload_cpu(prefetch: int = 2, pin_memory: bool = True) -> CpuOffload:
    return CpuOffload(prefetch=prefetch, pin_memory=pin_memory)


def register(registry: Registering) -> None:
    registry.register(
        "none",
        _none,
        lossless=True,
        summary="identity: stores saved tensors as they are and counts them",
    )
    registry.register(
        "offload.cpu",
        _offload_cpu,
        lossless=True,
        summary="saved tensors to pinned host memory on a side stream, prefetched for backward",
    )
