"""Seeds for random codes (stochastic rounding, random dropping): a private stream per compressor.

Drawing from torch's global generator would shift the user's own random stream (dropout
masks, sampling) and make a run with quantization incomparable with one without. Each
compressor instead keys Philox with ``base + k * golden`` for its k-th tensor: independent
streams, reproducible from ``seed`` (default: ``torch.initial_seed()``), no device sync.
"""

from __future__ import annotations

import itertools
import threading

import torch

_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class SeedStream:
    def __init__(self, seed: int | None = None) -> None:
        self.base = (torch.initial_seed() if seed is None else int(seed)) & _MASK64
        self._count = itertools.count(1)
        self._lock = threading.Lock()

    def next(self) -> int:
        with self._lock:
            k = next(self._count)
        return (self.base + k * _GOLDEN) & _MASK64
