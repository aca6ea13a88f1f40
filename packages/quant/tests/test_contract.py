"""Every quant codec passes the core's compressor contract."""

from __future__ import annotations

import pytest
import torch

from torchstash import Site
from torchstash.compressor import Compressor
from torchstash.testing.contract import CompressorContract
from torchstash_quant import Fp8Quantizer, GroupQuantizer, MesaQuantizer
from torchstash_quant.auto import AutoQuantizer


class TestInt8(CompressorContract):
    max_error = 0.01
    min_grad_cosine = 0.999

    def make_compressor(self) -> Compressor:
        return GroupQuantizer(8)


class TestInt4(CompressorContract):
    max_error = 0.15
    min_grad_cosine = 0.99

    def make_compressor(self) -> Compressor:
        return GroupQuantizer(4)


class TestInt2(CompressorContract):
    max_error = 0.7
    min_grad_cosine = 0.7  # one step of a small MLP; measured 0.79 (see the README)

    def make_compressor(self) -> Compressor:
        return GroupQuantizer(2)


class TestInt1(CompressorContract):
    max_error = 1.0
    min_grad_cosine = 0.1  # measured 0.15: one bit is for memory at any cost

    def make_compressor(self) -> Compressor:
        return GroupQuantizer(1)

    def test_nonfinite_tensor_is_coded_at_two_bits(self, device: torch.device) -> None:
        """At one bit a single spare code would make every non-finite value NaN: a tensor
        holding NaN or Inf is coded at 2 bits instead (the contract's NaN/Inf test holds),
        and a finite one stays at 1 bit."""
        self._check_device(device)
        x = torch.randn(4096, device=device)
        assert self.make_compressor().compress(x, Site()).meta["bits"] == 1
        x[1000] = float("inf")
        packed = self.make_compressor().compress(x, Site())
        assert packed.meta["bits"] == 2


class TestInt8SmallGroups(TestInt8):
    def make_compressor(self) -> Compressor:
        return GroupQuantizer(8, group_size=7)


class TestMesa(CompressorContract):
    max_error = 0.01
    min_grad_cosine = 0.999

    def make_compressor(self) -> Compressor:
        return MesaQuantizer()


class TestFp8(CompressorContract):
    max_error = 0.07
    min_grad_cosine = 0.999

    def make_compressor(self) -> Compressor:
        return Fp8Quantizer()


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_packed_bytes_are_what_the_bits_say(bits: int) -> None:
    """codes: bits/8 bytes per element; lo and step: 2 bytes each per 256-element group."""
    x = torch.randn(1 << 16)
    p = GroupQuantizer(bits).compress(x, Site())
    assert p.nbytes() == (1 << 16) * bits // 8 + (1 << 16) // 256 * 4


def test_fp8_bytes_count_the_padded_codes() -> None:
    """quant.fp8 codes whole groups and keeps a view of the first ``n`` codes: the record
    holds the padded buffer, 1024 bytes for 1000 elements, and 4 bfloat16 scales."""
    p = Fp8Quantizer().compress(torch.randn(1000), Site())
    codes = p.tensors["codes"]
    assert isinstance(codes, torch.Tensor) and codes.numel() == 1000
    assert p.nbytes() == 1024 + 4 * 2


class TestAuto(CompressorContract):
    """Before its first allocation every site runs at the budget's width (2 bits)."""

    max_error = 0.7
    min_grad_cosine = 0.7

    def make_compressor(self) -> Compressor:
        return AutoQuantizer()
