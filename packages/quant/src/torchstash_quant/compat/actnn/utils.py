"""ActNN's ``utils``: memory figures and the experiment recorder (see :mod:`.._memory`)."""

from __future__ import annotations

from .._memory import (
    GlobalExpRecorder,
    compute_tensor_bytes,
    disable_cache_allocator,
    empty_cache,
    enable_cache_allocator,
    exp_recorder,
    get_memory_usage,
    swap_to_cpu,
)

__all__ = [
    "GlobalExpRecorder",
    "compute_tensor_bytes",
    "disable_cache_allocator",
    "empty_cache",
    "enable_cache_allocator",
    "exp_recorder",
    "get_memory_usage",
    "swap_to_cpu",
]
