"""The strategies the core ships: ``none`` and ``offload.cpu``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .compressor import AS_IS
from .offload import CpuOffload

if TYPE_CHECKING:
    from .registry import Registry


def _none() -> object:
    """Stores every saved tensor as it is (and counts it): the baseline for measurement."""
    return AS_IS


def _offload_cpu(prefetch: int = 2, pin_memory: bool = True) -> CpuOffload:
    return CpuOffload(prefetch=prefetch, pin_memory=pin_memory)


def register(registry: Registry) -> None:
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
