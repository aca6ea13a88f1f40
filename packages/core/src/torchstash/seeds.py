"""Seeds for random codes (stochastic rounding, random dropping): a private stream per compressor.

Drawing from torch's global generator would shift the user's own random stream (dropout
masks, sampling) and make a run with quantization incomparable with one without. Each
compressor instead keys Philox with ``base + k * golden`` for its k-th tensor: independent
streams, reproducible from ``seed`` (default: ``torch.initial_seed()``), no device sync.

Inside a compiled graph an int seed would be a constant (the same draws every step): while
the compiled path traces a code (:mod:`torchstash.graphhooks`), :func:`traced` hands the
code a seed tensor the graph computes instead.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class SeedStream:
    def __init__(self, seed: int | None = None) -> None:
        self.base = (torch.initial_seed() if seed is None else int(seed)) & _MASK64
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def next(self) -> int:
        """The stream's next seed (while a code is traced for a compiled graph, the graph's
        seed tensor: :func:`traced`; the kernels take either)."""
        traced_seed = getattr(_TRACED, "seed", None)
        if traced_seed is not None:
            return traced_seed
        with self._lock:
            k = next(self._count)
        return (self.base + k * _GOLDEN) & _MASK64


_TRACED = threading.local()


@contextmanager
def traced(seed: torch.Tensor) -> Iterator[None]:
    """Every :meth:`SeedStream.next` on this thread gives ``seed`` (a 0-dim int64 tensor of a
    graph being traced) until the block ends."""
    before = getattr(_TRACED, "seed", None)
    _TRACED.seed = seed
    try:
        yield
    finally:
        _TRACED.seed = before
