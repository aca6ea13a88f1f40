"""Fused per-group quantization: the kernels against the reference bit for bit, the spec's
edge cases, its statistics (unbiasedness, error bound), validation and torch.library.

Every parity test runs on CPU and (marked ``cuda``, skipped without a GPU) on CUDA, always
against the reference evaluated on CPU. NaN payloads are not part of the spec: torch's own
fp32 -> bf16 cast writes 0xFFFF or 0x7FC0 for a NaN depending on its CPU code path, so NaNs
are compared by position (``test_reserved_codes_decode_to_canonical_values`` pins the
kernels' own NaN bits).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import pytest
import torch

from torchstash import env
from torchstash.errors import KernelUnavailable
from torchstash.kernels import Impl, group_dequantize, group_quantize, loader
from torchstash.kernels import groupquant_reference as gq_ref
from torchstash.kernels.groupquant_reference import (
    group_dequantize_ref,
    group_quantize_ref,
    num_groups,
)
from torchstash.testing.bits import INT_VIEW, assert_bits_equal
from torchstash.testing.hostreads import device_waits

BITS = [1, 2, 4, 8]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GROUP_SIZES = [256, 64, 7, 1000]
SIZES = [1, 255, 257, 100003]
IMPLS: tuple[Impl, ...] = ("kernel", "ref")
F32_MAX = torch.finfo(torch.float32).max
INF, NAN = float("inf"), float("nan")


def _data(n: int, group_size: int, seed: int) -> torch.Tensor:
    """float32 with a different scale and offset per group, some values on a bfloat16 grid."""
    gen = torch.Generator().manual_seed(seed)
    groups = num_groups(n, group_size)
    scale = torch.exp(torch.randn(groups, generator=gen) * 3).repeat_interleave(group_size)[:n]
    offset = (torch.randn(groups, generator=gen) * 10).repeat_interleave(group_size)[:n]
    x = torch.randn(n, generator=gen) * scale + offset
    on_grid = torch.rand(n, generator=gen) < 0.1
    return torch.where(on_grid, x.to(torch.bfloat16).float(), x)


def within_step(x: torch.Tensor, y: torch.Tensor, step: torch.Tensor) -> bool:
    """|x - y| <= step elementwise, up to float32 rounding: (x - lo) / step and
    lo + code * step are each rounded (a few ulps of |x|, or of the subnormal spacing)."""
    x, y, step = x.double().cpu(), y.double().cpu(), step.double().cpu()
    slack = 2.0**-21 * (x.abs() + y.abs()) + 2.0**-147
    return bool(((x - y).abs() <= step + slack).all())


def check_parity(
    device: torch.device,
    x: torch.Tensor,
    bits: int,
    group_size: int,
    seed: int = 1234,
    stochastic: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel on ``device`` against the reference on CPU: packed, lo, step, and the values
    dequantized into every float dtype. Returns the reference's (packed, lo, step)."""
    want = group_quantize_ref(x, bits, group_size, seed, stochastic)
    got = group_quantize(
        x.to(device), bits, group_size, seed=seed, stochastic=stochastic, impl="kernel"
    )
    assert all(t.device.type == device.type for t in got)
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    n = x.numel()
    for dtype in DTYPES:
        y = group_dequantize(*got, bits, group_size, n, dtype, impl="kernel")
        assert y.device.type == device.type
        assert_bits_equal(y, group_dequantize_ref(*want, bits, group_size, n, dtype))
    return want


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_parity(
    kernel: None,
    device: torch.device,
    bits: int,
    dtype: torch.dtype,
    group_size: int,
    n: int,
    stochastic: bool,
) -> None:
    x = _data(n, group_size, seed=n + group_size).to(dtype)
    check_parity(device, x, bits, group_size, seed=n * 31 + bits, stochastic=stochastic)


@pytest.mark.parametrize("seed", [0, 2**32 + 5, 2**63, 2**64 - 1])
def test_parity_across_the_seed_range(kernel: None, device: torch.device, seed: int) -> None:
    check_parity(device, _data(4099, 64, seed=3), 2, 64, seed=seed)


@pytest.mark.parametrize("group_size", [1, 2, 3, 5, 9, 13])
@pytest.mark.parametrize("bits", BITS)
def test_bytes_straddling_groups(
    kernel: None, device: torch.device, bits: int, group_size: int
) -> None:
    """Group sizes whose groups start mid-byte, enough groups for several tasks."""
    check_parity(device, _data(70001, group_size, seed=group_size), bits, group_size)


def test_results_do_not_depend_on_thread_count(kernels_on: None) -> None:
    x = _data(300007, 7, seed=5)
    old = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, max(2, old)):
            torch.set_num_threads(threads)
            q = group_quantize(x, 1, 7, seed=9, impl="kernel")
            outs.append((*q, group_dequantize(*q, 1, 7, x.numel(), torch.float32, impl="kernel")))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


# --------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("bits", BITS)
def test_nonfinite_values_come_back_in_place(kernel: None, device: torch.device, bits: int) -> None:
    x = _data(1000, 64, seed=11)
    x[[3, 100, 101, 700]] = NAN
    x[[5, 130, 999]] = INF
    x[[6, 131, 500]] = -INF
    packed, lo, step = check_parity(device, x, bits, 64)
    special = torch.zeros(num_groups(1000, 64), dtype=torch.bool)
    special[[0, 1, 2, 7, 10, 15]] = True
    assert torch.equal(torch.signbit(step.float()), special)
    y = group_dequantize(packed.to(device), lo.to(device), step.to(device), bits, 64, 1000,
                         torch.float32, impl="kernel").cpu()  # fmt: skip
    finite = x.isfinite()
    assert bool(y[finite].isfinite().all())
    if bits >= 2:
        assert torch.equal(y.isnan(), x.isnan())
        assert torch.equal(y == INF, x == INF) and torch.equal(y == -INF, x == -INF)
    else:  # one bit: every non-finite value is NaN
        assert torch.equal(y.isnan(), ~finite)


@pytest.mark.parametrize("bits", BITS)
def test_reserved_codes_decode_to_canonical_values(
    kernel: None, device: torch.device, bits: int
) -> None:
    x = torch.tensor([NAN, INF, -INF, 1.0, -NAN, 2.0])
    q = group_quantize(x.to(device), bits, 6, seed=0, impl="kernel")
    canonical = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
    for dtype, bits_of_nan in canonical.items():
        y = group_dequantize(*q, bits, 6, 6, dtype, impl="kernel").cpu()
        nan_bits = y[y.isnan()].view(INT_VIEW[dtype]).to(torch.int64) & 0xFFFFFFFF
        assert set(nan_bits.tolist()) == {bits_of_nan}


@pytest.mark.parametrize("bits", BITS)
def test_all_nan_group(kernel: None, device: torch.device, bits: int) -> None:
    x = torch.cat([torch.full((64,), NAN), _data(64, 64, seed=1)])
    packed, lo, step = check_parity(device, x, bits, 64)
    assert lo[0].item() == 0.0 and step.view(torch.int16)[0].item() == -0x8000  # -0.0: special
    y = group_dequantize_ref(packed, lo, step, bits, 64, 128, torch.float32)
    assert bool(y[:64].isnan().all()) and bool(y[64:].isfinite().all())


@pytest.mark.parametrize("bits", BITS)
def test_constant_groups(kernel: None, device: torch.device, bits: int) -> None:
    values = [0.0, 1.0, -2.5, 3.14159, -1e-3, 1e30, 65504.0]  # some off the bfloat16 grid
    x = torch.tensor(values).repeat_interleave(33)
    packed, lo, step = check_parity(device, x, bits, 33)
    y = group_dequantize_ref(packed, lo, step, bits, 33, x.numel(), torch.float32)
    for g, v in enumerate(values):
        exact = float(torch.tensor(v).to(torch.bfloat16)) == v
        assert (step[g].item() == 0.0) == exact
        err = (y[g * 33 : (g + 1) * 33].double() - v).abs()
        assert bool((err == 0).all()) if exact else bool((err <= step[g].item()).all())
    assert within_step(x, y, step.float().repeat_interleave(33))


def test_signed_zeros_are_canonical(kernel: None, device: torch.device) -> None:
    """A group of +0.0 and -0.0 (in any arrangement) stores lo = +0.0 and step = +0.0."""
    x = torch.zeros(7 * 64)
    x[::3] = -0.0
    x[64:128] = -0.0
    for bits in BITS:
        _, lo, step = check_parity(device, x, bits, 64)
        assert not bool(torch.signbit(lo.float()).any())
        assert not bool(torch.signbit(step.float()).any())


HUGE = {
    "max_and_min": [F32_MAX, -F32_MAX, 1.0, 0.0],
    "beyond_bf16": [3.39e38, 3.0e38, 1e38, 3.395e38],
    "below_bf16": [-3.399e38, -3.0e38, -1.0, 0.0],
    "wide_span": [3.3e38, -3.3e38, 0.0, 1e37],
    "near_max": [F32_MAX, F32_MAX * 0.999, F32_MAX * 0.99, F32_MAX * 0.9],
    "with_inf": [F32_MAX, INF, -F32_MAX, NAN],
}


@pytest.mark.parametrize("case", sorted(HUGE))
@pytest.mark.parametrize("bits", BITS)
def test_huge_values(kernel: None, device: torch.device, bits: int, case: str) -> None:
    """Values near the float32 maximum, where lo/step overflow to +-inf: still bit for bit
    (including the NaN codes of inf / inf, which the spec defines as 0)."""
    x = torch.tensor(HUGE[case]).repeat(9)
    for group_size in (4, 36):
        for stochastic in (True, False):
            check_parity(device, x, bits, group_size, stochastic=stochastic)


def test_huge_values_within_the_bfloat16_range_round_trip(kernel: None) -> None:
    x = torch.linspace(1e38, 3e38, 1000)
    packed, lo, step = group_quantize(x, 8, 100, seed=1, impl="kernel")
    y = group_dequantize(packed, lo, step, 8, 100, 1000, torch.float32, impl="kernel")
    assert bool(y.isfinite().all())
    assert within_step(x, y, step.float().repeat_interleave(100))


@pytest.mark.parametrize("bits", BITS)
def test_denormals(kernel: None, device: torch.device, bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    tiny = torch.randn(4096, generator=gen) * 1e-39  # float32 subnormals (< 1.18e-38)
    tiny[::7] = torch.randn(586, generator=gen) * 1e-44
    assert bool((tiny.abs() < torch.finfo(torch.float32).tiny).all())
    packed, lo, step = check_parity(device, tiny, bits, 64)
    assert bool((lo.float() != 0).any()) and bool((step.float() != 0).all())
    y = group_dequantize_ref(packed, lo, step, bits, 64, 4096, torch.float32)
    assert within_step(tiny, y, step.float().repeat_interleave(64))


def _subnormal_groups(seed: int) -> torch.Tensor:
    """Groups of 64 whose finite values are all subnormal: of both signs, positive (with
    zeros, as after a ReLU), negative, with NaN and Inf, one nonzero value, and ones whose
    largest magnitude sits next to the smallest normal float32."""
    gen = torch.Generator().manual_seed(seed)
    groups = torch.randn(8, 64, generator=gen) * 1e-40
    groups[1] = groups[1].clamp_min(0)
    groups[2] = -groups[2].abs()
    groups[3, [5, 9, 40]] = torch.tensor([NAN, INF, -INF])
    groups[4] = 0.0
    groups[4, 17] = 3e-45
    groups[5] = groups[5] / groups[5].abs().max() * 5e-39
    groups[6] = groups[6] / groups[6].abs().max() * 1.1754942e-38  # 2**-126: 1.1754944e-38
    groups[7] = groups[7].clamp_max(0)
    return groups.reshape(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_subnormal_groups_are_coded_at_full_precision(
    kernel: None, device: torch.device, bits: int, dtype: torch.dtype
) -> None:
    """A group whose finite values are all subnormal is coded scaled by 2**126 (exact): its
    error stays within a step of its own range, as a normal group's does. bfloat16's
    subnormal steps (multiples of 2**-133) made int8 codes of randn * 1e-40 about 2 bits
    wide. NaN and Inf come back in place, zeros of a one-signed group exactly."""
    x = _subnormal_groups(seed=bits).to(dtype)
    packed, lo, step = check_parity(device, x, bits, 64)
    got_lo = group_quantize(x.to(device), bits, 64, seed=1234, impl="kernel")[1].cpu()
    assert torch.equal(got_lo.view(torch.int16), lo.view(torch.int16))  # NaN patterns too
    if dtype == torch.float32:  # every group tiny: its lo a NaN pattern naming its shape
        shapes = lo.view(torch.int16).to(torch.int32) - gq_ref.TINY_LO
        assert shapes[:3].tolist() == [gq_ref.BOTH, gq_ref.POSITIVE, gq_ref.NEGATIVE]
        assert bool(((shapes >= 1) & (shapes <= 3)).all())
    y = group_dequantize_ref(packed, lo, step, bits, 64, x.numel(), torch.float32)
    xf = x.float()
    if bits >= 2:
        assert torch.equal(y.isnan(), xf.isnan()) and torch.equal(y.isinf(), xf.isinf())
        assert torch.equal(y[xf.isinf()], xf[xf.isinf()])
    else:  # one bit: every non-finite value is NaN
        assert torch.equal(y.isnan(), ~xf.isfinite())
    finite = xf.isfinite().view(8, 64)
    top = torch.tensor([gq_ref.levels(bits, bool(s)) for s in (~finite).any(dim=1)])
    big = torch.where(finite, xf.view(8, 64).abs(), 0.0).amax(dim=1)
    bound = torch.where(top > 0, 2 * big.double() / top.clamp_min(1), big.double()) * 1.01
    err = torch.where(finite, (xf - y).view(8, 64).double().abs(), 0.0)
    assert bool((err <= bound[:, None] + 2.0**-149).all()), (err.amax(dim=1), bound)
    zeros = xf.view(8, 64)[1] == 0
    assert bool(zeros.any()) and bool((y.view(8, 64)[1][zeros] == 0).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_empty(kernel: None, device: torch.device, impl: Impl) -> None:
    for shape in [(0,), (0, 5), (3, 0, 2)]:
        for bits in BITS:
            x = torch.empty(shape, device=device)
            packed, lo, step = group_quantize(x, bits, seed=0, impl=impl)
            assert packed.shape == (0,) and packed.dtype == torch.uint8
            assert lo.shape == step.shape == (0,) and lo.dtype == step.dtype == torch.bfloat16
            for dtype in DTYPES:
                y = group_dequantize(packed, lo, step, bits, 256, 0, dtype, impl=impl)
                assert y.shape == (0,) and y.dtype == dtype and y.device.type == device.type


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_channels_last(
    kernel: None, device: torch.device, dtype: torch.dtype
) -> None:
    # the views are taken on the device: .to() would make a strided slice contiguous
    base = _data(2 * 3 * 17 * 19, 19, seed=4).view(2, 3, 17, 19).to(device, dtype)
    views = [
        base.to(memory_format=torch.channels_last),
        base.transpose(1, 3),
        base[:, :, ::2],
        base.view(6, 323).t()[5:],
    ]
    for x in views:
        assert not x.is_contiguous()
        want = group_quantize_ref(x.cpu().contiguous(), 4, 64, 77, True)
        got = group_quantize(x, 4, 64, seed=77, impl="kernel")
        for g, w in zip(got, want):
            assert_bits_equal(g, w)
        for g, w in zip(group_quantize(x, 4, 64, seed=77, impl="ref"), want):
            assert_bits_equal(g, w)


def test_storage_offset_input(kernel: None, device: torch.device) -> None:
    x = _data(1003, 64, seed=2).to(device)[3:]  # contiguous, unaligned data pointer
    check_parity(device, x.cpu(), 2, 64)
    got = group_quantize(x, 2, 64, seed=1234, impl="kernel")
    assert torch.equal(got[0].cpu(), group_quantize_ref(x.cpu(), 2, 64, 1234)[0])


@pytest.mark.parametrize("bits", BITS)
def test_many_small_groups(kernel: None, device: torch.device, bits: int) -> None:
    """Far more groups than blocks in a CUDA grid (grid-stride over runs of groups)."""
    check_parity(device, _data(400003, 1, seed=bits), bits, 1)


def test_large_group_sizes(kernel: None, device: torch.device) -> None:
    """Groups larger than the CPU kernel's span, and group_size >= numel (one group)."""
    x = _data(30011, 5000, seed=8)
    for group_size in (2049, 5000, 30011, 10**6):
        for bits in (1, 8):
            check_parity(device, x, bits, group_size)
    # Any group size >= numel is one group (the reference would pad to 2**40 elements).
    want = group_quantize_ref(x, 4, x.numel(), 5)
    got = group_quantize(x.to(device), 4, 2**40, seed=5, impl="kernel")
    for g, w in zip(got, want):
        assert_bits_equal(g, w)
    y = group_dequantize(*got, 4, 2**40, x.numel(), torch.float32, impl="kernel")
    assert_bits_equal(y, group_dequantize_ref(*want, 4, x.numel(), x.numel(), torch.float32))


# --------------------------------------------------------------------------- statistics

SEEDS = 256


def unbiased_violations(x: torch.Tensor, samples: torch.Tensor, step: torch.Tensor) -> int:
    """Elements whose mean over the sampled seeds is more than 5 standard errors from x.

    Each element's samples take at most two adjacent levels a and a + step; with k of S
    at the upper one, the standard error uses the Agresti-Coull estimate
    p = (k + 2) / (S + 4), so that an element whose S samples all agree (k = 0, common when
    x sits close to a level) is not held to a zero standard error.
    """
    s = samples.shape[0]
    hi = samples.max(dim=0).values
    k = (samples == hi).sum(dim=0).double()
    k = torch.where(samples.min(dim=0).values == hi, 0.0, k)
    p = (k + 2) / (s + 4)
    se = step * (p * (1 - p) / s).sqrt()
    return int(((samples.mean(dim=0) - x).abs() > 5 * se).sum())


def _sample_seeds(x: torch.Tensor, impl: Impl, stochastic: bool = True) -> torch.Tensor:
    out = []
    for seed in range(SEEDS):
        q = group_quantize(x, 2, 64, seed=seed, stochastic=stochastic, impl=impl)
        out.append(group_dequantize(*q, 2, 64, x.numel(), torch.float32, impl=impl).double())
    return torch.stack(out)


def _group_step(x: torch.Tensor) -> torch.Tensor:
    step = group_quantize_ref(x, 2, 64, 0)[2].double().abs()
    return step.repeat_interleave(64)[: x.numel()]


def test_unbiased_over_seeds(kernels_on: None) -> None:
    """E[dequantize(quantize(x))] = x: the mean over 256 seeds is within 5 standard errors
    of x for every element (2 bits, the coarsest grid where rounding dominates)."""
    x = _data(4096, 64, seed=21)
    samples = _sample_seeds(x, "kernel")
    levels = (samples.max(dim=0).values - samples.min(dim=0).values) / _group_step(x)
    assert bool((levels <= 1 + 1e-6).all())  # two adjacent levels at most
    assert unbiased_violations(x.double(), samples, _group_step(x)) == 0


def test_unbiasedness_check_catches_biased_rounding(
    kernels_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statistical test has power: round-to-nearest, and uniforms squeezed into
    [0, 0.5), fail it for most elements."""
    x = _data(4096, 64, seed=21)
    step = _group_step(x)
    nearest = _sample_seeds(x, "kernel", stochastic=False)
    assert unbiased_violations(x.double(), nearest, step) > 0.5 * x.numel()
    real = gq_ref.philox_uniform_ref

    def squeezed(numel: int, seed: int, offset: int = 0, *, device: Any = "cpu") -> torch.Tensor:
        return real(numel, seed, offset, device=device) * 0.5

    monkeypatch.setattr(gq_ref, "philox_uniform_ref", squeezed)
    biased = _sample_seeds(x, "ref")
    assert unbiased_violations(x.double(), biased, step) > 0.3 * x.numel()


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("bits", BITS)
def test_error_bound(kernel: None, device: torch.device, bits: int, stochastic: bool) -> None:
    """|x - y| <= step for every element of a normal group (float32 output), up to the
    float32 rounding of (x - lo) / step and of lo + code * step (a few ulps of |x|)."""
    x = _data(100003, 256, seed=bits)
    q = group_quantize(x.to(device), bits, 256, seed=3, stochastic=stochastic, impl="kernel")
    y = group_dequantize(*q, bits, 256, x.numel(), torch.float32, impl="kernel")
    step = q[2].cpu().float().repeat_interleave(256)[: x.numel()]
    assert not bool(torch.signbit(step).any())  # no special group in this data
    assert within_step(x, y, step)
    if not stochastic:  # round to nearest: half a step
        assert within_step(x, y, step / 2)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_clear_errors(kernels_on: None, impl: Impl) -> None:
    x = _data(100, 10, seed=0)
    q = group_quantize(x, 2, 10, seed=0, impl=impl)
    not_a_tensor: Any = [1.0]
    not_a_bool: Any = 1
    with pytest.raises(ValueError, match=r"bits=3 .*allowed values are 1, 2, 4, 8"):
        group_quantize(x, 3, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 1.*got 0"):
        group_quantize(x, 2, 0, seed=0, impl=impl)
    with pytest.raises(TypeError, match=r"x must be one of float32, float16, bfloat16.*int32"):
        group_quantize(x.int(), 2, seed=0, impl=impl)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        group_quantize(not_a_tensor, 2, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        group_quantize(x, 2, seed=-1, impl=impl)
    with pytest.raises(TypeError, match="stochastic must be a bool"):
        group_quantize(x, 2, seed=0, stochastic=not_a_bool, impl=impl)
    with pytest.raises(ValueError, match="bits"):
        group_dequantize(*q, 5, 10, 100, torch.float32, impl=impl)
    with pytest.raises(ValueError, match="need exactly 50 packed bytes, got 25"):
        group_dequantize(*q, 4, 10, 100, torch.float32, impl=impl)
    with pytest.raises(ValueError, match=r"lo must be 1-D with 4 entries"):
        group_dequantize(q[0], q[1], q[2], 2, 25, 100, torch.float32, impl=impl)
    with pytest.raises(TypeError, match="step must be bfloat16"):
        group_dequantize(q[0], q[1], q[2].float(), 2, 10, 100, torch.float32, impl=impl)
    with pytest.raises(TypeError, match=r"dtype must be one of float32, float16, bfloat16"):
        group_dequantize(*q, 2, 10, 100, torch.int8, impl=impl)
    with pytest.raises(ValueError, match="numel"):
        group_dequantize(*q, 2, 10, -1, torch.float32, impl=impl)
    with pytest.raises(ValueError, match="group_size"):
        group_dequantize(*q, 2, -4, 100, torch.float32, impl=impl)


def test_invalid_impl() -> None:
    bad: Any = "fast"
    with pytest.raises(ValueError, match="impl='fast' is not valid"):
        group_quantize(torch.ones(3), 2, seed=0, impl=bad)


def test_ops_validate_direct_calls(kernels_on: None) -> None:
    """The C++ checks guard torch.ops.torchstash.* callers that skip the Python layer."""
    ops = torch.ops.torchstash
    x = torch.randn(20)
    with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8"):
        ops.group_quantize(x, 3, 4, 0, True)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        ops.group_quantize(x, 2, 0, 0, True)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        ops.group_quantize(x.double(), 2, 4, 0, True)
    packed, lo, step = ops.group_quantize(x, 2, 4, -1, True)  # seed 2**64 - 1 as int64
    with pytest.raises(ValueError, match="need exactly 5 packed bytes"):
        ops.group_dequantize(packed[:4], lo, step, 2, 4, 20, torch.float32)
    with pytest.raises(ValueError, match="lo must be 1-D with 5 entries"):
        ops.group_dequantize(packed, lo[:3], step, 2, 4, 20, torch.float32)
    with pytest.raises(TypeError, match="step must be bfloat16"):
        ops.group_dequantize(packed, lo, step.half(), 2, 4, 20, torch.float32)
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        ops.group_dequantize(packed, lo, step, 2, 4, 20, torch.float64)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        ops.group_dequantize(packed, lo, step, 2, 0, 20, torch.float32)


# --------------------------------------------------------------------------- torch.library


@pytest.mark.parametrize("bits", BITS)
def test_opcheck(built: None, bits: int) -> None:
    x = _data(37 * 3, 16, seed=bits)
    args = [(x, bits, 16, 5, True), (x.half().view(3, 37).t(), bits, 7, 2**63 - 1, False)]
    for a in args:
        torch.library.opcheck(torch.ops.torchstash.group_quantize.default, a)
    packed, lo, step = torch.ops.torchstash.group_quantize(x, bits, 16, 5, True)
    for dtype in DTYPES:
        torch.library.opcheck(
            torch.ops.torchstash.group_dequantize.default,
            (packed, lo, step, bits, 16, x.numel(), dtype),
        )


def test_torch_compile_traces_the_ops(built: None) -> None:
    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        packed, lo, step = torch.ops.torchstash.group_quantize(x, 4, 64, 3, True)
        return torch.ops.torchstash.group_dequantize(
            packed, lo, step, 4, 64, x.numel(), torch.float32
        )

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    x = _data(1001, 64, seed=6)
    assert torch.equal(compiled(x), roundtrip(x))


# --------------------------------------------------------------------------- a traced seed


def _seed(value: int) -> torch.Tensor:
    return torch.tensor(value - 2**64 if value >= 2**63 else value, dtype=torch.int64)


@pytest.mark.parametrize("bits", BITS)
def test_the_seeded_overload_draws_what_the_int_seed_draws(built: None, bits: int) -> None:
    """``group_quantize.seeded`` (a 0-dim int64 tensor for the seed, what a compiled graph
    passes) gives the int seed's codes bit for bit, and the reference's with that tensor."""
    x = _data(37 * 41, 16, seed=bits)
    for seed in (0, 5, 2**63 - 1, 2**63 + 5, 2**64 - 1):
        want = group_quantize(x, bits, 16, seed=seed, impl="kernel")
        for impl in ("kernel", "ref"):
            got = group_quantize(x, bits, 16, seed=_seed(seed), impl=impl)
            for a, b in zip(got, want, strict=True):
                assert_bits_equal(a, b)


def test_a_seed_tensor_on_the_data_s_device_is_read_without_a_host_sync(
    kernel: None, device: torch.device
) -> None:
    """On a GPU the kernel reads a device seed (a compiled graph's) itself: no host sync, and
    the codes the CPU kernel gives with that seed as an int."""
    x = _data(4099, 64, seed=3)
    want = group_quantize(x, 4, 64, seed=2**63 + 5, impl="kernel")
    seed = _seed(2**63 + 5).to(device)
    xd = x.to(device)
    waits: contextlib.AbstractContextManager[list[list[str]]] = contextlib.nullcontext([])
    if device.type == "cuda":
        torch.cuda.synchronize()
        waits = device_waits()
    with waits as stacks:
        got = group_quantize(xd, 4, 64, seed=seed, impl="kernel", checked=False)
    assert not stacks, f"the kernel waited for the device: {stacks}"
    for a, b in zip(got, want, strict=True):
        assert_bits_equal(a.cpu(), b)


def test_opcheck_seeded(built: None) -> None:
    x = _data(37 * 3, 16, seed=1)
    for a in [(x, 4, 16, _seed(5), True), (x.half().view(3, 37).t(), 2, 7, _seed(2**64 - 1), True)]:
        torch.library.opcheck(torch.ops.torchstash.group_quantize.seeded, a)


def test_a_compiled_graph_takes_its_seed_as_an_input_and_draws_it_each_call(built: None) -> None:
    """Compiled with its seed an input, the kernel gives the int seed's codes for every seed
    with one compilation; a seed drawn inside the graph (``torch.randint``) is a new one each
    call, so a compiled step never rounds with the same draws twice."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    frames = CompileCounterWithBackend("aot_eager")

    def code(x: torch.Tensor, seed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.torchstash.group_quantize.seeded(x, 4, 64, seed, True)

    compiled = torch.compile(code, backend=frames, fullgraph=True)
    x = _data(1001, 64, seed=6)
    for seed in (3, 2**63 + 5, 2**64 - 1):
        got = compiled(x, _seed(seed))
        for a, b in zip(got, group_quantize(x, 4, 64, seed=seed, impl="kernel"), strict=True):
            assert_bits_equal(a, b)
    assert frames.frame_count == 1

    def drawn(x: torch.Tensor) -> torch.Tensor:
        seed = torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64)
        return torch.ops.torchstash.group_quantize.seeded(x, 4, 64, seed, True)[0]

    step = torch.compile(drawn, backend="inductor", fullgraph=True)
    torch.manual_seed(0)
    first, second = step(x), step(x)
    assert not torch.equal(first, second)  # new draws each call
    torch.manual_seed(0)
    assert torch.equal(step(x), first)  # and torch's generator decides them


# --------------------------------------------------------------------------- dispatch


def test_kernel_path_is_the_compiled_op(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchstash.kernels.groupquant as gq_mod

    calls: list[str] = []

    def spy_q(*args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls.append("quantize")
        return group_quantize_ref(*args)

    def spy_d(*args: Any) -> torch.Tensor:
        calls.append("dequantize")
        return group_dequantize_ref(*args)

    monkeypatch.setattr(gq_mod, "group_quantize_ref", spy_q)
    monkeypatch.setattr(gq_mod, "group_dequantize_ref", spy_d)
    x = torch.randn(10)
    q = group_quantize(x, 2, seed=0)
    group_dequantize(*q, 2, 256, 10, torch.float32)
    assert calls == []
    q = group_quantize(x, 2, seed=0, impl="ref")
    group_dequantize(*q, 2, 256, 10, torch.float32, impl="ref")
    assert calls == ["quantize", "dequantize"]


def test_off_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "off")
    x = _data(300, 64, seed=1)
    got = group_quantize(x, 2, 64, seed=4)
    for g, w in zip(got, group_quantize_ref(x, 2, 64, 4)):
        assert torch.equal(g, w)
    with pytest.raises(KernelUnavailable, match="TORCHSTASH_KERNELS=off"):
        group_quantize(x, 2, 64, seed=4, impl="kernel")


def test_loader_builds_without_fp_contraction() -> None:
    assert "-ffp-contract=off" in loader._flags()[0]


def test_bench_smoke(kernels_on: None) -> None:
    from torchstash.kernels import bench

    rows = bench.run(mib=0.25, repeat=1, suites=("groupquant",))
    assert [(r.op, r.bits) for r in rows] == [
        ("group_quantize", 2),
        ("group_dequantize", 2),
        ("group_quantize", 8),
        ("group_dequantize", 8),
    ]
    assert all(r.ref_ms > 0 and r.kernel_ms > 0 and not r.copy for r in rows)
    assert "group_dequantize" in bench.format_table(rows)
    with pytest.raises(ValueError, match="unknown bench suite"):
        bench.run(mib=0.25, repeat=1, suites=("nope",))


# --------------------------------------------------------------------------- large inputs


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _reference_window(
    x: torch.Tensor, start: int, bits: int, group_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference on x[start:start + w] as if it sat at element ``start`` of a longer
    tensor: the uniforms come from the right Philox blocks (start and w multiples of 4
    and of group_size)."""
    from torchstash.kernels.reference import _philox_blocks

    window = x[start : start + 4 * 1024].float()
    w = window.numel()

    def shifted(numel: int, seed_: int, offset: int = 0, *, device: Any = "cpu") -> torch.Tensor:
        words = _philox_blocks(start // 4, (numel + 3) // 4, seed_, offset, torch.device(device))
        return ((words.reshape(-1)[:numel] >> 8).to(torch.float32)) * 2.0**-24

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gq_ref, "philox_uniform_ref", shifted)
        return group_quantize_ref(window[:w], bits, group_size, seed, True)


@pytest.mark.slow
def test_beyond_int32_elements(kernels_on: None, request: pytest.FixtureRequest) -> None:
    """2**31 + 4096 bfloat16 elements at 1 bit on CPU: the groups, Philox blocks and packed
    bytes past 2**31 must be the right ones. About 8.5 GiB (input, output, codes)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow (about 8.5 GiB of memory): run with -m slow")
    if _available_memory() < 10 * 2**30:
        pytest.skip("needs about 10 GiB of free memory")
    n, group_size, seed = 2**31 + 4096, 256, 2**64 - 7
    x = torch.zeros(n, dtype=torch.bfloat16)
    edges = [0, 2**31 - 2048, n - 4096]
    for start in edges:
        x[start : start + 4096] = _data(4096, group_size, seed=start % 1000).to(torch.bfloat16)
    packed, lo, step = group_quantize(x, 1, group_size, seed=seed, impl="kernel")
    assert packed.numel() == n // 8 and lo.numel() == n // group_size
    for start in edges:
        want = _reference_window(x, start, 1, group_size, seed)
        g0 = start // group_size
        assert torch.equal(packed[start // 8 : start // 8 + 512], want[0])
        assert torch.equal(lo[g0 : g0 + 16].view(torch.int16), want[1].view(torch.int16))
        assert torch.equal(step[g0 : g0 + 16].view(torch.int16), want[2].view(torch.int16))
    assert not bool(packed[1024 : (2**31 - 2048) // 8].any())  # zero groups: codes 0
    y = group_dequantize(packed, lo, step, 1, group_size, n, torch.bfloat16, impl="kernel")
    del packed
    for start in edges:
        want = _reference_window(x, start, 1, group_size, seed)
        expected = group_dequantize_ref(*want, 1, group_size, 4096, torch.bfloat16)
        assert_bits_equal(y[start : start + 4096], expected)
