"""``level_quantize`` (stochastic rounding to a table of levels, bit-packed: the derivative
codes' one pass) against its reference bit for bit, on the CPU and CUDA kernels and on the
composed path a device without them takes; the rounding's definition; validation;
torch.library."""

from __future__ import annotations

import pytest
import torch

from torchstash.errors import KernelUnavailable
from torchstash.kernels import level_quantize, levelquant, unpack_bits
from torchstash.kernels.levelquant import level_quantize_ref
from torchstash.kernels.reference import philox_uniform_ref

INF, NAN = float("inf"), float("nan")


def _data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * 1.5
    if n > 10:
        x[3], x[5], x[7], x[9] = NAN, INF, -INF, -0.0
    return x.to(dtype)


def _levels(count: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.linspace(-1.0, 1.0, count)
    return (base + 0.3 / count * torch.rand(count, generator=gen)).sort().values


@pytest.mark.parametrize("n", [0, 1, 7, 9, 2049, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("bits", "count"), [(2, 2), (2, 3), (4, 15), (4, 5), (8, 17), (8, 255)])
def test_parity(kernels_on: None, n: int, dtype: torch.dtype, bits: int, count: int) -> None:
    """The kernel (short tables walked level by level, long ones searched) and the composed
    path give the reference's bytes, seeds past 2**63 included."""
    x, levels = _data(n, dtype), _levels(count)
    for seed in (0, 2**63 + 5):
        want = level_quantize_ref(x, levels, bits, seed)
        assert torch.equal(level_quantize(x, levels, bits, seed=seed, impl="kernel"), want)
        assert torch.equal(composed(x, levels, bits, seed), want)


def composed(x: torch.Tensor, levels: torch.Tensor, bits: int, seed: int) -> torch.Tensor:
    """The path a device without the kernel takes: PyTorch ops over the Philox and
    bit-packing kernels."""
    return levelquant._composed(x, levels, bits, seed, golden=False)


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 1, 7, 9, 2049, 70001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("bits", "count"), [(2, 3), (4, 15), (4, 5), (8, 17), (8, 255)])
def test_parity_on_cuda(n: int, dtype: torch.dtype, bits: int, count: int) -> None:
    """The CUDA kernel (one thread per Philox block; short tables walked, long ones searched)
    gives the reference's bytes, NaN/Inf and seeds past 2**63 included, and reads a strided
    view in contiguous order."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible to torch here")
    x, levels = _data(n, dtype), _levels(count)
    for seed in (3, 2**63 + 5):
        want = level_quantize_ref(x, levels, bits, seed)
        got = level_quantize(x.cuda(), levels.cuda(), bits, seed=seed, impl="kernel")
        assert torch.equal(got.cpu(), want)
    wide = torch.randn(40, 30, device="cuda").to(dtype).t()  # a view taken on the device
    want = level_quantize_ref(wide.cpu().contiguous(), levels, bits, 9)
    got = level_quantize(wide, levels.cuda(), bits, seed=9, impl="kernel")
    assert torch.equal(got.cpu(), want)


def test_non_contiguous_input_is_read_in_contiguous_order(kernels_on: None) -> None:
    x = torch.randn(40, 30).t()
    levels = _levels(3)
    want = level_quantize_ref(x.contiguous(), levels, 2, 9)
    assert torch.equal(level_quantize(x, levels, 2, seed=9, impl="kernel"), want)


def test_the_rounding_is_the_definition() -> None:
    """Each code is the level below or above its value, the upper one with probability equal
    to the value's position between them; outside the table, the nearest end; NaN the top
    code (the reference's own definition pinned)."""
    levels = torch.tensor([-1.0, 0.0, 2.0])
    x = torch.tensor([-3.0, -1.0, -0.5, 0.0, 1.0, 2.0, 5.0, INF, -INF, NAN])
    codes = unpack_bits(level_quantize_ref(x, levels, 2, 3), 2, x.numel())
    u = philox_uniform_ref(x.numel(), 3)
    for i, v in enumerate(x.tolist()):
        c = int(codes[i])
        if v != v:
            assert c == 3
        elif v <= -1.0:
            assert c == 0
        elif v >= 2.0:
            assert c == 2
        else:
            upper = 1 if v <= 0.0 else 2
            low, high = float(levels[upper - 1]), float(levels[upper])
            assert c == upper - int(float(u[i]) * (high - low) >= v - low)


def test_codes_are_unbiased() -> None:
    levels = torch.tensor([0.0, 0.25, 1.0])
    x = torch.full((200_000,), 0.4)
    codes = unpack_bits(level_quantize(x, levels, 2, seed=5), 2, x.numel()).long()
    assert levels[codes].mean().item() == pytest.approx(0.4, abs=2e-3)


def test_validation() -> None:
    x = torch.randn(10)
    with pytest.raises(ValueError, match="2 to 3 values"):
        level_quantize(x, torch.zeros(4), 2, seed=0)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8"):
        level_quantize(x, torch.zeros(1), 1, seed=0)
    with pytest.raises(TypeError, match="1-D float32"):
        level_quantize(x, torch.zeros(3, dtype=torch.float64), 2, seed=0)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        level_quantize(x.double(), torch.zeros(3), 2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        level_quantize(x, torch.zeros(3), 2, seed=-1)


def test_a_device_without_the_kernel_says_so(kernels_on: None) -> None:
    x = torch.randn(10, device="meta")
    with pytest.raises(KernelUnavailable):
        level_quantize(x, torch.zeros(3, device="meta"), 2, seed=0, impl="kernel")


def test_opcheck(built: None) -> None:
    op = torch.ops.torchstash.level_quantize.default
    for x in (torch.randn(6, 64), torch.randn(6, 64).bfloat16(), torch.randn(64, 6).t()):
        torch.library.opcheck(op, (x, _levels(3), 2, 7))
        torch.library.opcheck(op, (x, _levels(200), 8, 7))
