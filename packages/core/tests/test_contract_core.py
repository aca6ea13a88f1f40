"""The shipped contract suite, run on the core's compressors and on the test toys."""

from __future__ import annotations

import torch

from torchstash.compressor import Composed, Compressor
from torchstash.offload import CpuOffload
from torchstash.testing.contract import CompressorContract
from torchstash.testing.toys import CloneCompressor, HalfCompressor


class TestClone(CompressorContract):
    lossless = True

    def make_compressor(self) -> Compressor:
        return CloneCompressor()

    def expect_smaller(self, dtype: torch.dtype) -> bool:
        return False


class TestHalf(CompressorContract):
    max_error = 0.01
    min_grad_cosine = 0.999

    def make_compressor(self) -> Compressor:
        return HalfCompressor()

    def expect_smaller(self, dtype: torch.dtype) -> bool:
        return dtype == torch.float32


class TestComposed(TestHalf):
    """Composition keeps the contract: clone's payload goes through half."""

    def make_compressor(self) -> Compressor:
        return Composed(CloneCompressor(), HalfCompressor())


class TestOffload(CompressorContract):
    """offload.cpu on the GPU: lossless, every payload byte in host memory."""

    lossless = True
    devices = ("cuda",)

    def make_compressor(self) -> Compressor:
        return CpuOffload()

    def expect_smaller(self, dtype: torch.dtype) -> bool:
        return False
