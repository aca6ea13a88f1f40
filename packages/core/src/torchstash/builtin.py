"""The strategies the core ships: ``none`` and ``offload.cpu``."""

from __future__ import annotations

from .compressor import AS_IS
from .declare import Registering, StrategyTable
from .offload import CpuOffload

STRATEGIES = StrategyTable()


@STRATEGIES.strategy("none", lossless=True)
def _none() -> object:
    """Identity: stores saved tensors as they are and counts them (the baseline)."""
    return AS_IS


@STRATEGIES.strategy("offload.cpu", lossless=True)
def _offload_cpu(prefetch: int = 2, pin_memory: bool = True) -> CpuOffload:
    """Saved tensors to pinned host memory on a side stream, prefetched for backward."""
    return CpuOffload(prefetch=prefetch, pin_memory=pin_memory)


def register(registry: Registering) -> None:
    STRATEGIES.register(registry)
