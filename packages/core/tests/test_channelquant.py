"""Channel-wise 8-bit quantization (Mesa's layout): the kernels against the reference bit for
bit, the spec's edge cases, validation and torch.library.

Every parity test runs on CPU and (marked ``cuda``, skipped without a GPU) on CUDA, always
against the reference evaluated on CPU. NaN payloads are not part of the spec (torch's own
fp32 -> bf16 cast writes 0xFFFF or 0x7FC0 depending on its CPU code path), so NaNs are
compared by position; ``test_reserved_codes_decode_to_canonical_values`` pins the kernels'
own NaN bits. The host-compiled check at the end runs channelquant.h's per-element
functions, the ones the CUDA kernels call, against the reference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchstash import env
from torchstash.errors import KernelUnavailable
from torchstash.kernels import (
    Impl,
    channel_dequantize,
    channel_minmax,
    channel_quantize,
    mesa_quantize,
)
from torchstash.kernels.channelquant_reference import (
    channel_dequantize_ref,
    channel_index,
    channel_minmax_ref,
    channel_quantize_ref,
    mesa_quantize_ref,
)
from torchstash.testing.bits import INT_VIEW, assert_bits_equal
from torchstash.testing.native import build_host_program, run_host_program

from ._helpers import DTYPES, IMPLS, INF, NAN, assert_bad_impl_refused, spy_on

F32_MAX = torch.finfo(torch.float32).max

# (outer, channels, inner): per head (long runs), per channel (inner = 1), small inner
# (per-column min/max), runs longer than a span and than a CPU task, more channels than the
# CPU kernel keeps per-column partials for, one channel, one element.
LAYOUTS = [
    (1, 1, 1),
    (3, 1, 517),
    (2, 4, 4096),
    (1, 2, 40001),
    (999, 7, 1),
    (37, 13, 3),
    (5, 9, 63),
    (6, 5, 64),
    (1, 65537, 1),
    (1, 16385, 4),
]
LAYOUT_IDS = [f"{o}x{c}x{i}" for o, c, i in LAYOUTS]


def _data(outer: int, channels: int, inner: int, seed: int) -> torch.Tensor:
    """float32 (outer * channels * inner,) with a different scale and offset per channel,
    some NaN/Inf, a channel of non-finite values only and a constant channel (when C >= 3)."""
    gen = torch.Generator().manual_seed(seed)
    n = outer * channels * inner
    cid = channel_index(n, inner, channels, "cpu")
    scale = torch.exp(torch.randn(channels, generator=gen) * 3)[cid]
    offset = (torch.randn(channels, generator=gen) * 10)[cid]
    x = torch.randn(n, generator=gen) * scale + offset
    special = torch.rand(n, generator=gen)
    x[special < 0.002] = NAN
    x[(special >= 0.002) & (special < 0.004)] = INF
    x[(special >= 0.004) & (special < 0.006)] = -INF
    if channels >= 3:
        x[cid == 1] = torch.where(torch.rand(n, generator=gen)[cid == 1] < 0.5, NAN, -INF)
        x[cid == 2] = 0.7
    return x


def _params(x: torch.Tensor, inner: int, channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """lo and step as Mesa chooses them (0, 0 for a channel without finite values)."""
    mn, mx = channel_minmax_ref(x, inner, channels)
    seen = mn <= mx
    lo = torch.where(seen, mn, 0.0)
    step = torch.clamp(torch.where(seen, mx, 0.0) - lo, min=0.0) / 252
    return lo, step


def check_parity(
    device: torch.device,
    x: torch.Tensor,
    lo: torch.Tensor,
    step: torch.Tensor,
    inner: int,
    seed: int = 1234,
    stochastic: bool = True,
) -> torch.Tensor:
    """Kernel on ``device`` against the reference on CPU: the codes, and the values decoded
    into every float dtype. Returns the reference's codes."""
    want = channel_quantize_ref(x, lo, step, inner, seed, stochastic)
    d = (x.to(device), lo.to(device), step.to(device))
    got = channel_quantize(*d, inner, seed=seed, stochastic=stochastic, impl="kernel")
    assert got.device.type == device.type
    assert_bits_equal(got, want)
    for dtype in DTYPES:
        y = channel_dequantize(got, d[1], d[2], inner, dtype, impl="kernel")
        assert y.device.type == device.type
        assert_bits_equal(y, channel_dequantize_ref(want, lo, step, inner, dtype))
    return want


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_minmax_parity(
    kernel: None, device: torch.device, dtype: torch.dtype, layout: tuple[int, int, int]
) -> None:
    outer, channels, inner = layout
    x = _data(outer, channels, inner, seed=sum(layout)).to(dtype)
    want = channel_minmax_ref(x, inner, channels)
    got = channel_minmax(x.to(device), inner, channels, impl="kernel")
    for g, w in zip(got, want):
        assert g.device.type == device.type
        assert_bits_equal(g, w)


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_parity(
    kernel: None,
    device: torch.device,
    dtype: torch.dtype,
    layout: tuple[int, int, int],
    stochastic: bool,
) -> None:
    outer, channels, inner = layout
    x = _data(outer, channels, inner, seed=sum(layout)).to(dtype)
    lo, step = _params(x, inner, channels)
    codes = check_parity(device, x, lo, step, inner, seed=outer * 31 + inner, stochastic=stochastic)
    if channels >= 3:  # the constant channel has step 0: every code 0
        assert not bool(codes.view(outer, channels, inner)[:, 2].any())


MESA_LAYOUTS = [(1, 1, 1), (37, 13, 3), (6, 5, 64), (2, 130, 7), (999, 7, 1), (4, 256, 16)]


@pytest.mark.parametrize("stochastic", [True, False], ids=["stochastic", "nearest"])
@pytest.mark.parametrize("running", ["none", "running"])
@pytest.mark.parametrize("layout", MESA_LAYOUTS, ids=[f"{o}x{c}x{i}" for o, c, i in MESA_LAYOUTS])
def test_mesa_quantize_parity(
    kernel: None,
    device: torch.device,
    layout: tuple[int, int, int],
    running: str,
    stochastic: bool,
) -> None:
    """quant.mesa's one call: codes, range and running range bit for bit, per channel, per
    group of channels (64 groups of 130 or 256 channels, 4 of 13) and one group, starting a
    running range or blending into one (whose unseen groups keep theirs)."""
    outer, channels, inner = layout
    x = _data(outer, channels, inner, seed=sum(layout))
    for groups in sorted({1, channels, min(channels, 64), max(1, channels // 3)}):
        run = None
        if running == "running":
            gen = torch.Generator().manual_seed(groups)
            run = torch.randn(2, groups, generator=gen).sort(dim=0).values * 4
        for decay in (0.9, 0.0, 0.37):
            seed = outer * 31 + groups
            want = mesa_quantize_ref(x, inner, channels, groups, run, decay, seed, stochastic)
            got = mesa_quantize(
                x.to(device),
                inner,
                channels,
                groups,
                None if run is None else run.to(device),
                decay,
                seed=seed,
                stochastic=stochastic,
                impl="kernel",
            )
            for g, w in zip(got, want, strict=True):
                assert g.device.type == device.type
                assert_bits_equal(g, w)
            if channels >= 3 and groups == channels:  # channel 1 holds no finite value:
                keep = 0.0 if run is None else run[:, 1]  # its running range is kept
                assert torch.equal(want[3][:, 1].cpu(), torch.as_tensor(keep).expand(2))


def test_mesa_quantize_is_the_two_passes_it_fuses(kernels_on: None) -> None:
    """Its codes are channel_quantize's with each channel's group's lo and step, and its
    range is channel_minmax's taken per group: the fused call changes no code."""
    outer, channels, inner = 5, 130, 6
    x = _data(outer, channels, inner, seed=3)
    codes, lo, step, run = mesa_quantize(x, inner, channels, 64, None, 0.9, seed=11)
    gid = torch.arange(channels) * 64 // channels
    assert torch.equal(codes, channel_quantize(x, lo[gid], step[gid], inner, seed=11))
    mn, _ = channel_minmax(x, inner, channels)
    seen_min = torch.full((64,), INF).scatter_reduce(0, gid, mn, "amin")
    assert_bits_equal(run[0], torch.where(seen_min.isfinite(), seen_min, 0.0))


@pytest.mark.parametrize("impl", IMPLS)
def test_mesa_quantize_refuses_bad_arguments(kernels_on: None, impl: Impl) -> None:
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"groups \(4\) must be at most channels \(3\)"):
        mesa_quantize(x, 4, 3, 4, None, 0.9, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"running must be float32 of shape \(2, 3\)"):
        mesa_quantize(x, 4, 3, 3, torch.zeros(3, 2), 0.9, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"not a multiple of inner \* channels \(5 \* 3\)"):
        mesa_quantize(x, 5, 3, 3, None, 0.9, seed=0, impl=impl)
    with pytest.raises(TypeError, match=r"x must be one of float32, float16, bfloat16"):
        mesa_quantize(x.int(), 4, 3, 3, None, 0.9, seed=0, impl=impl)


def test_mesa_quantize_op_checks_its_arguments(kernels_on: None) -> None:
    """The compiled op refuses what ``checked=False`` lets through, naming the argument."""
    ops = torch.ops.torchstash
    x = torch.randn(24)
    with pytest.raises(ValueError, match=r"mesa_quantize: groups must be in \[1, channels = 3\]"):
        ops.mesa_quantize(x, 8, 3, 4, None, 0.9, 0, True)
    with pytest.raises(
        ValueError, match=r"mesa_quantize: running must have shape \(2, groups = 3\)"
    ):
        ops.mesa_quantize(x, 8, 3, 3, torch.zeros(2, 2), 0.9, 0, True)
    with pytest.raises(TypeError, match="mesa_quantize: running must be float32"):
        ops.mesa_quantize(x, 8, 3, 3, torch.zeros(2, 3, dtype=torch.float64), 0.9, 0, True)
    with pytest.raises(ValueError, match=r"mesa_quantize: x has 24 elements, not a multiple"):
        ops.mesa_quantize(x, 5, 3, 3, None, 0.9, 0, True)


@pytest.mark.parametrize("seed", [0, 2**32 + 5, 2**63, 2**64 - 1])
def test_parity_across_the_seed_range(kernel: None, device: torch.device, seed: int) -> None:
    x = _data(9, 5, 91, seed=3)
    check_parity(device, x, *_params(x, 91, 5), 91, seed=seed)


def test_results_do_not_depend_on_thread_count(kernels_on: None) -> None:
    old = torch.get_num_threads()
    cases = [(_data(61, 4, 2048, seed=5), 2048, 4), (_data(3001, 3, 1, seed=6), 1, 3)]
    try:
        for x, inner, channels in cases:
            lo, step = _params(x, inner, channels)
            outs = []
            for threads in (1, max(2, old)):
                torch.set_num_threads(threads)
                codes = channel_quantize(x, lo, step, inner, seed=9, impl="kernel")
                outs.append(
                    (
                        *channel_minmax(x, inner, channels, impl="kernel"),
                        codes,
                        channel_dequantize(codes, lo, step, inner, torch.float32, impl="kernel"),
                    )
                )
            for a, b in zip(*outs):
                assert_bits_equal(a, b)
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------- edge cases


def test_nonfinite_values_and_channels(kernel: None, device: torch.device) -> None:
    x = torch.tensor([[1.0, NAN, -2.0, INF], [NAN, NAN, INF, -INF], [-INF, 3.0, 0.5, 0.25]]).repeat(
        2, 1
    )  # (outer 2 * 3 channels, inner 4)
    mn, mx = channel_minmax(x.to(device), 4, 3, impl="kernel")
    assert mn.cpu().tolist() == [-2.0, INF, 0.25] and mx.cpu().tolist() == [1.0, -INF, 3.0]
    lo, step = torch.tensor([-2.0, 0.0, 0.25]), torch.tensor([3.0 / 252, 0.0, 2.75 / 252])
    codes = check_parity(device, x, lo, step, 4)
    reserved = {NAN: 255, INF: 254, -INF: 253}
    for v, c in reserved.items():
        where = x.isnan().reshape(-1) if v != v else (x == v).reshape(-1)
        assert bool((codes[where] == c).all())
    assert bool((codes[x.isfinite().reshape(-1)] <= 252).all())
    y = channel_dequantize(codes, lo, step, 4, torch.float32, impl="kernel").view(x.shape)
    assert torch.equal(y.isnan(), x.isnan())
    assert torch.equal(y == INF, x == INF) and torch.equal(y == -INF, x == -INF)
    assert y[0, 2].item() == -2.0 and y[2, 3].item() == 0.25  # the ends are exact


def test_reserved_codes_decode_to_canonical_values(kernel: None, device: torch.device) -> None:
    codes = torch.tensor([255, 254, 253, 0, 252, 255], dtype=torch.uint8, device=device)
    lo, step = torch.zeros(1, device=device), torch.ones(1, device=device)
    canonical = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
    for dtype, bits_of_nan in canonical.items():
        y = channel_dequantize(codes, lo, step, 6, dtype, impl="kernel").cpu()
        nan_bits = y[y.isnan()].view(INT_VIEW[dtype]).to(torch.int64) & 0xFFFFFFFF
        assert set(nan_bits.tolist()) == {bits_of_nan}
        assert y[1].item() == INF and y[2].item() == -INF and y[4].item() == 252.0


def test_unusual_parameters(kernel: None, device: torch.device) -> None:
    """The spec covers any lo and step: zero, negative, NaN and infinite steps give code 0 for
    finite values, as does a NaN quotient (an infinite lo, a step of inf)."""
    x = torch.tensor([-3.0, 0.0, 1.5, F32_MAX, -F32_MAX, 7.0, NAN, INF, -INF]).repeat(8)
    steps = [0.0, -1.0, NAN, INF, 1e-45, 2.0, F32_MAX, 0.5]
    los = [0.0, 0.0, 0.0, -INF, -3.0, INF, -F32_MAX, NAN]
    lo, step = torch.tensor(los), torch.tensor(steps)
    for stochastic in (True, False):
        check_parity(device, x, lo, step, 9, stochastic=stochastic)
    codes = channel_quantize_ref(x, lo, step, 9, 0).view(8, 9)
    assert not bool(codes[:3, :6].any())  # steps 0, -1, NaN


def test_signed_zeros_are_canonical(kernel: None, device: torch.device) -> None:
    x = torch.zeros(4, 3, 40)
    x[:, 0] = -0.0
    x[::2, 1, ::3] = -0.0
    mn, mx = channel_minmax(x.to(device), 40, 3, impl="kernel")
    for t in (mn, mx):
        assert not bool(torch.signbit(t.cpu()).any()) and not bool(t.cpu().any())


@pytest.mark.parametrize("impl", IMPLS)
def test_empty(kernel: None, device: torch.device, impl: Impl) -> None:
    for shape in [(0,), (0, 5), (3, 0, 2)]:
        x = torch.empty(shape, device=device)
        mn, mx = channel_minmax(x, 2, 5, impl=impl)
        assert mn.tolist() == [INF] * 5 and mx.tolist() == [-INF] * 5
        assert mn.dtype == mx.dtype == torch.float32 and mn.device.type == device.type
        lo, step = torch.zeros(5, device=device), torch.ones(5, device=device)
        codes = channel_quantize(x, lo, step, 2, seed=0, impl=impl)
        assert codes.shape == (0,) and codes.dtype == torch.uint8
        for dtype in DTYPES:
            y = channel_dequantize(codes, lo, step, 2, dtype, impl=impl)
            assert y.shape == (0,) and y.dtype == dtype and y.device.type == device.type


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(kernel: None, device: torch.device, dtype: torch.dtype) -> None:
    """Any strides: the values of x.contiguous(), in its row-major order."""
    # the views are taken on the device: .to() would make a strided slice contiguous
    base = _data(2, 6, 17 * 19, seed=4).view(2, 6, 17, 19).to(device, dtype)
    views = [
        (base.to(memory_format=torch.channels_last), 17 * 19, 6),
        (base.transpose(1, 3), 1, 6),
        (base[:, :, ::2], 9 * 19, 6),
        (base.view(12, 323).t()[5:], 1, 12),
    ]
    for x, inner, channels in views:
        assert not x.is_contiguous()
        dense = x.cpu().contiguous()
        for g, w in zip(
            channel_minmax(x, inner, channels, impl="kernel"),
            channel_minmax_ref(dense, inner, channels),
        ):
            assert_bits_equal(g, w)
        lo, step = _params(dense, inner, channels)
        got = channel_quantize(x, lo.to(device), step.to(device), inner, seed=77, impl="kernel")
        assert_bits_equal(got, channel_quantize_ref(dense, lo, step, inner, 77))


def test_storage_offset_input(kernel: None, device: torch.device) -> None:
    x = _data(1, 4, 1001, seed=2)
    lo, step = _params(x, 1001, 4)
    shifted = torch.cat([torch.zeros(3), x]).to(device)[3:]  # contiguous, unaligned data pointer
    got = channel_quantize(shifted, lo.to(device), step.to(device), 1001, seed=5, impl="kernel")
    codes = channel_quantize_ref(x, lo, step, 1001, 5)
    assert_bits_equal(got, codes)
    packed = torch.cat([torch.zeros(1, dtype=torch.uint8), codes]).to(device)[1:]  # unaligned codes
    y = channel_dequantize(
        packed, lo.to(device), step.to(device), 1001, torch.float16, impl="kernel"
    )
    assert_bits_equal(y, channel_dequantize_ref(codes, lo, step, 1001, torch.float16))


def test_same_seed_same_codes(kernels_on: None) -> None:
    x = _data(16, 4, 512, seed=8)
    lo, step = _params(x, 512, 4)
    a = channel_quantize(x, lo, step, 512, seed=11, impl="kernel")
    assert torch.equal(a, channel_quantize(x, lo, step, 512, seed=11, impl="kernel"))
    b = channel_quantize(x, lo, step, 512, seed=12, impl="kernel")
    assert not torch.equal(a, b)
    ya = channel_dequantize(a, lo, step, 512, torch.float32, impl="kernel")
    yb = channel_dequantize(b, lo, step, 512, torch.float32, impl="kernel")
    finite = x.isfinite()
    assert bool(((ya - x).abs() <= step.repeat_interleave(512).repeat(16) * 1.0001)[finite].all())
    assert torch.equal(ya.isnan(), yb.isnan())  # the non-finite codes do not depend on the seed


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_clear_errors(kernels_on: None, impl: Impl) -> None:
    x = torch.randn(2, 3, 4)
    lo, step = torch.zeros(3), torch.ones(3)
    codes = channel_quantize(x, lo, step, 4, seed=0, impl=impl)
    not_a_tensor: Any = [1.0]
    not_a_bool: Any = 1
    with pytest.raises(TypeError, match=r"x must be one of float32, float16, bfloat16.*int32"):
        channel_minmax(x.int(), 4, 3, impl=impl)
    with pytest.raises(ValueError, match=r"inner must be an int >= 1, got 0; .*N \* D"):
        channel_minmax(x, 0, 3, impl=impl)
    with pytest.raises(ValueError, match=r"channels must be an int >= 1, got -1"):
        channel_minmax(x, 4, -1, impl=impl)
    with pytest.raises(
        ValueError, match=r"24 elements, not a multiple of inner \* channels \(5 \* 3\)"
    ):
        channel_minmax(x, 5, 3, impl=impl)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        channel_quantize(not_a_tensor, lo, step, 4, seed=0, impl=impl)
    with pytest.raises(
        TypeError, match=r"lo must be float32, got torch.bfloat16; convert it with \.float\(\)"
    ):
        channel_quantize(x, lo.bfloat16(), step, 4, seed=0, impl=impl)
    with pytest.raises(TypeError, match="step must be float32, got torch.float64"):
        channel_quantize(x, lo, step.double(), 4, seed=0, impl=impl)
    with pytest.raises(
        ValueError, match=r"lo and step must have one entry per channel each, got 3 and 2"
    ):
        channel_quantize(x, lo, step[:2], 4, seed=0, impl=impl)
    with pytest.raises(
        ValueError, match=r"lo must be 1-D with one entry per channel, got shape \(1, 3\)"
    ):
        channel_quantize(x, lo.view(1, 3), step, 4, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"not a multiple of inner \* channels \(4 \* 2\)"):
        channel_quantize(x[:, :, :3], lo[:2], step[:2], 4, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"inner must be an int >= 1"):
        channel_quantize(x, lo, step, 0, seed=0, impl=impl)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        channel_quantize(x, lo, step, 4, seed=-1, impl=impl)
    with pytest.raises(TypeError, match="stochastic must be a bool"):
        channel_quantize(x, lo, step, 4, seed=0, stochastic=not_a_bool, impl=impl)
    with pytest.raises(TypeError, match="codes must be uint8, got torch.int8"):
        channel_dequantize(codes.to(torch.int8), lo, step, 4, torch.float32, impl=impl)
    with pytest.raises(ValueError, match="codes must be 1-D, got 2 dims"):
        channel_dequantize(codes.view(6, 4), lo, step, 4, torch.float32, impl=impl)
    with pytest.raises(ValueError, match=r"codes has 24 elements, not a multiple"):
        channel_dequantize(codes, lo, step, 3, torch.float32, impl=impl)
    with pytest.raises(TypeError, match=r"dtype must be one of float32, float16, bfloat16"):
        channel_dequantize(codes, lo, step, 4, torch.float64, impl=impl)
    with pytest.raises(TypeError, match="step must be float32"):
        channel_dequantize(codes, lo, step.half(), 4, torch.float32, impl=impl)


def test_invalid_impl() -> None:
    assert_bad_impl_refused(channel_minmax, torch.ones(3), 1, 3)


def test_ops_validate_direct_calls(kernels_on: None) -> None:
    """The C++ checks guard torch.ops.torchstash.* callers that skip the Python layer."""
    ops = torch.ops.torchstash
    x, lo, step = torch.randn(24), torch.zeros(3), torch.ones(3)
    with pytest.raises(TypeError, match="channel_minmax: x must be float32, float16 or bfloat16"):
        ops.channel_minmax(x.double(), 4, 3)
    with pytest.raises(ValueError, match=r"channel_minmax: inner must be >= 1 \(got 0\); .*N \* D"):
        ops.channel_minmax(x, 0, 3)
    with pytest.raises(ValueError, match="channel_minmax: channels must be >= 1"):
        ops.channel_minmax(x, 4, 0)
    with pytest.raises(
        ValueError, match=r"x has 24 elements, not a multiple of inner \* channels \(5 \* 3\)"
    ):
        ops.channel_minmax(x, 5, 3)
    with pytest.raises(TypeError, match="channel_quantize: lo must be float32"):
        ops.channel_quantize(x, lo.half(), step, 4, 0, True)
    with pytest.raises(
        ValueError, match="lo and step must have one entry per channel each, got 3 and 2"
    ):
        ops.channel_quantize(x, lo, step[:2], 4, 0, True)
    with pytest.raises(ValueError, match="step must be 1-D with one entry per channel"):
        ops.channel_quantize(x, lo, step.view(3, 1), 4, 0, True)
    with pytest.raises(ValueError, match="channel_quantize: inner must be >= 1"):
        ops.channel_quantize(x, lo, step, -2, 0, True)
    codes = ops.channel_quantize(x, lo, step, 4, -1, True)  # seed 2**64 - 1 as int64
    with pytest.raises(TypeError, match="channel_dequantize: codes must be uint8"):
        ops.channel_dequantize(codes.float(), lo, step, 4, torch.float32)
    with pytest.raises(ValueError, match="codes must be 1-D"):
        ops.channel_dequantize(codes.view(2, 12), lo, step, 4, torch.float32)
    with pytest.raises(ValueError, match=r"codes has 24 elements, not a multiple"):
        ops.channel_dequantize(codes, lo, step, 16, torch.float32)
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        ops.channel_dequantize(codes, lo, step, 4, torch.float64)


# --------------------------------------------------------------------------- torch.library


def test_opcheck(built: None) -> None:
    x = torch.randn(3, 4, 5) * torch.tensor([1.0, 10.0, 0.0, 3.0]).view(4, 1)  # finite: opcheck
    lo, step = _params(x, 5, 4)  # compares outputs without equal_nan
    for inner, xs in ((5, x), (1, x.half().view(15, 4)), (3, x.bfloat16().view(4, 15).t())):
        torch.library.opcheck(torch.ops.torchstash.channel_minmax.default, (xs, inner, 4))
    torch.library.opcheck(torch.ops.torchstash.channel_quantize.default, (x, lo, step, 5, 5, True))
    torch.library.opcheck(
        torch.ops.torchstash.channel_quantize.default,
        (x.half().view(15, 4), lo, step, 1, 2**63 - 1, False),
    )
    codes = torch.ops.torchstash.channel_quantize(x, lo, step, 5, 5, True)
    for dtype in DTYPES:
        torch.library.opcheck(
            torch.ops.torchstash.channel_dequantize.default, (codes, lo, step, 5, dtype)
        )


def test_torch_compile_traces_the_ops(built: None) -> None:
    def roundtrip(x: torch.Tensor) -> torch.Tensor:
        mn, mx = torch.ops.torchstash.channel_minmax(x, 16, 4)
        step = (mx - mn) / 252
        codes = torch.ops.torchstash.channel_quantize(x, mn, step, 16, 3, True)
        return torch.ops.torchstash.channel_dequantize(codes, mn, step, 16, torch.float32)

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 4, 16)
    assert torch.equal(compiled(x), roundtrip(x))


# --------------------------------------------------------------------------- dispatch


def test_kernel_path_is_the_compiled_op(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchstash.kernels.channelquant as cq_mod

    names = ("channel_minmax_ref", "channel_quantize_ref", "channel_dequantize_ref")
    calls = spy_on(monkeypatch, cq_mod, names)
    x = torch.randn(4, 8)
    for impl in ("auto", "ref"):
        mn, mx = channel_minmax(x, 1, 8, impl=impl)  # type: ignore[arg-type]
        codes = channel_quantize(x, mn, (mx - mn) / 252, 1, seed=0, impl=impl)  # type: ignore[arg-type]
        channel_dequantize(codes, mn, (mx - mn) / 252, 1, torch.float32, impl=impl)  # type: ignore[arg-type]
    assert calls == ["channel_minmax_ref", "channel_quantize_ref", "channel_dequantize_ref"]


def test_off_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "off")
    x = _data(7, 3, 11, seed=1)
    lo, step = _params(x, 11, 3)
    assert torch.equal(
        channel_quantize(x, lo, step, 11, seed=4), channel_quantize_ref(x, lo, step, 11, 4)
    )
    with pytest.raises(KernelUnavailable, match="TORCHSTASH_KERNELS=off"):
        channel_minmax(x, 11, 3, impl="kernel")


def test_bench_smoke(kernels_on: None) -> None:
    from torchstash.kernels import bench

    rows = bench.run(mib=0.25, repeat=1, suites=("channelquant",))
    assert [r.op for r in rows] == [
        "channel_minmax",
        "channel_quantize",
        "channel_dequantize",
        "channel_minmax",
        "channel_quantize",
        "channel_dequantize",
    ]
    assert all(r.ref_ms > 0 and r.kernel_ms > 0 and not r.copy for r in rows)
    assert "channel_quantize" in bench.format_table(rows)


# --------------------------------------------------------------------------- the header

PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "torchstash/channelquant.h"
using namespace torchstash;

// Out of line, so that the multiply of value_of has one use and could become an FMA.
__attribute__((noinline)) float decode(std::uint8_t code, float lo, float step) {
  return channelquant::value_of(code, lo, step);
}

// argv[1]: float32 quadruples (x, lo, step, u) in; argv[2]: per quadruple its code (u8), then
// for each code 0..255 with (lo, step) = quadruple k's: the float bits (u32).
int main(int argc, char** argv) {
  if (argc != 3) return 2;
  std::FILE* in = std::fopen(argv[1], "rb");
  std::vector<float> q;
  float v;
  while (std::fread(&v, 4, 1, in) == 1) q.push_back(v);
  std::fclose(in);
  std::FILE* out = std::fopen(argv[2], "wb");
  const std::size_t n = q.size() / 4;
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint8_t c = channelquant::code_of(q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]);
    std::fwrite(&c, 1, 1, out);
  }
  for (std::size_t k = 0; k < n; ++k) {
    for (int c = 0; c < 256; ++c) {
      const std::uint32_t b = groupquant::float_bits(decode(static_cast<std::uint8_t>(c), q[4 * k + 1], q[4 * k + 2]));
      std::fwrite(&b, 4, 1, out);
    }
  }
  std::fclose(out);
  return 0;
}
"""


def test_header_functions_match_the_reference(tmp_path: Any) -> None:
    """channelquant.h's code_of and value_of (what the CUDA kernels run), compiled for the
    host with the loader's flags and FMA available, against the reference."""
    program = build_host_program(PROGRAM, tmp_path)
    gen = torch.Generator().manual_seed(0)
    n = 4096
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
    lo = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
    step = torch.rand(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 4)
    u = torch.rand(n, generator=gen)
    x[:9] = torch.tensor([NAN, INF, -INF, F32_MAX, -F32_MAX, 0.0, -0.0, 1e-45, 3.0])
    step[9:18] = torch.tensor([0.0, -1.0, NAN, INF, 1e-45, 0.0, F32_MAX, 1e-30, INF])
    lo[18:24] = torch.tensor([INF, -INF, NAN, F32_MAX, -F32_MAX, 0.0])
    quads = torch.stack([x, lo, step, u], dim=1).contiguous()
    (tmp_path / "in.bin").write_bytes(quads.numpy().tobytes())
    run_host_program(program, str(tmp_path / "in.bin"), str(tmp_path / "out.bin"))
    data = (tmp_path / "out.bin").read_bytes()
    codes = torch.frombuffer(bytearray(data[:n]), dtype=torch.uint8)
    # The reference, one channel per quadruple (inner 1), its own u instead of Philox's.
    scaled = torch.where(step > 0, (x - lo) / torch.where(step > 0, step, 1.0), 0.0)
    q = torch.floor(scaled + u).clamp(0, 252)
    want = torch.where(q.isnan(), 0.0, q).to(torch.uint8)
    want = torch.where(
        x.isnan(), 255, torch.where(x == INF, 254, torch.where(x == -INF, 253, want))
    )
    assert torch.equal(codes, want.to(torch.uint8))
    values = torch.frombuffer(bytearray(data[n:]), dtype=torch.int32).view(torch.float32)
    all_codes = torch.arange(256, dtype=torch.uint8).repeat(n)
    expected = channel_dequantize_ref(
        all_codes, lo, step, 256, torch.float32
    )  # channel k: quadruple k's lo and step
    assert_bits_equal(values, expected)
