"""Both dropit compressors pass the shared compressor contract (at gamma 0.5: values within
half the range, gradients close)."""

from __future__ import annotations

from torchstash.compressor import Compressor
from torchstash.testing.contract import CompressorContract
from torchstash_dropit import MinK, RandomDrop


class TestMinK(CompressorContract):
    max_error = 0.5  # a dropped value is below the kept ones: at most the median magnitude
    min_grad_cosine = 0.9
    declines_below = 64  # a handful of values saves nothing in either sparse form

    def make_compressor(self) -> Compressor:
        return MinK(gamma=0.5, scope="tensor", min_numel=1)


class TestMinKRows(TestMinK):
    def make_compressor(self) -> Compressor:
        return MinK(gamma=0.5, scope="row", min_numel=1)


class TestMinKFeatures(TestMinK):
    def make_compressor(self) -> Compressor:
        return MinK(gamma=0.5, scope="feature", min_numel=1)


class TestRandomDrop(CompressorContract):
    max_error = 1.01  # a kept value doubles at p=0.5
    min_grad_cosine = 0.6  # unbiased, not close: one draw at p=0.5
    declines_below = 64

    def make_compressor(self) -> Compressor:
        return RandomDrop(p=0.5, min_numel=1, seed=0)


class TestMinKMeanFill(TestMinK):
    max_error = 1.0  # a dropped value's feature mean is within the range, not the median

    def make_compressor(self) -> Compressor:
        return MinK(gamma=0.5, min_numel=1, fill="mean")
