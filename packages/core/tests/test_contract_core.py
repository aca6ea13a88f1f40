"""The shipped contract suite, run on the core's compressors and on the test toys."""

from __future__ import annotations

import pytest
import torch

from torchstash.compressor import Composed, Compressor
from torchstash.offload import CpuOffload
from torchstash.plan import Swapped
from torchstash.testing.contract import CompressorContract, RewriterContract
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


class _ToyReLU(torch.nn.ReLU):
    """A ReLU subclass that computes the same: what a rewriter swaps in, at its simplest."""


class _ReLUSwap:
    name = "toy.relu"

    def rewrite(self, module: torch.nn.Module) -> Swapped | None:
        if type(module) is not torch.nn.ReLU:
            return None
        module.__class__ = _ToyReLU

        def undo() -> None:
            module.__class__ = torch.nn.ReLU

        return Swapped(module, undo)


class _FreshLinear:
    """A broken rewriter: a new Linear with its own Parameters (an optimizer built on the
    model's would miss them, and the state_dict loses the trained weights)."""

    name = "toy.fresh"

    def rewrite(self, module: torch.nn.Module) -> torch.nn.Module | None:
        if isinstance(module, torch.nn.Linear):
            return torch.nn.Linear(module.in_features, module.out_features)
        return None


class TestToyRewriter(RewriterContract):
    def make_rewriter(self) -> object:
        return _ReLUSwap()


def test_the_rewriter_contract_catches_a_rewriter_that_drops_the_parameters() -> None:
    class Broken(RewriterContract):
        def make_rewriter(self) -> object:
            return _FreshLinear()

    with pytest.raises(AssertionError):
        Broken().test_rewrites_and_keeps_the_models_state()
    with pytest.raises(AssertionError):
        Broken().test_gradients_and_outputs_match_stock(frozen=False)
