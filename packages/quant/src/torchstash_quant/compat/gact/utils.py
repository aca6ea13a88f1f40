"""GACT's ``utils``: memory figures and the experiment recorder (see :mod:`.._memory`)."""

from __future__ import annotations

from .._memory import (
    GlobalExpRecorder,
    compute_tensor_bytes,
    empty_cache,
    exp_recorder,
    get_memory_usage,
)

__all__ = [
    "GlobalExpRecorder",
    "compute_tensor_bytes",
    "empty_cache",
    "exp_recorder",
    "get_memory_usage",
]
