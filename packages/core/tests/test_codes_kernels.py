"""The kernels behind quant's one-pass codes, against their references bit for bit: rows
centered on their offset (``row_center``, ``row_uncenter`` and the fused ``row_group_*``),
e4m3 codes (``fp8_*``) and sign bits (``sign_*``); the references' own definitions pinned
(the lane order of a row's sum, torch's e4m3 cast); validation and torch.library.

Every parity test runs on CPU and (marked ``cuda``, skipped without a GPU) on CUDA, always
against the reference evaluated on CPU. NaN payloads are not part of the specs, so NaNs are
compared by position (:func:`assert_bits_equal`).
"""

from __future__ import annotations

import pytest
import torch

from torchstash.kernels import (
    fp8_dequantize,
    fp8_quantize,
    row_center,
    row_group_dequantize,
    row_group_quantize,
    row_uncenter,
    sign_pack,
    sign_select,
    sign_unpack,
)
from torchstash.kernels.fp8_reference import E4M3, fp8_dequantize_ref, fp8_quantize_ref
from torchstash.kernels.reference import sign_pack_ref, sign_select_ref, sign_unpack_ref
from torchstash.kernels.rowcenter_reference import (
    SUM_LANES,
    row_center_ref,
    row_group_dequantize_ref,
    row_group_quantize_ref,
    row_means_ref,
    row_uncenter_ref,
)
from torchstash.testing.bits import assert_bits_equal

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [1, 2, 4, 8]
INF, NAN = float("inf"), float("nan")
#: rows shorter than the 16 lanes, a row that is not a multiple of them, spans and tasks
RUNS = [7, 32, 100, 1024, 4100]
#: plain values; large means with small spreads; NaN/Inf; subnormals; values near float max;
#: constant rows (zeros of both signs among them)
KINDS = ["plain", "mean", "special", "tiny", "huge", "constant"]


def _data(n: int, kind: str, run: int = 1, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    if kind == "mean":
        x = x * 0.01 + 100.0
    elif kind == "tiny":
        x = x * 1e-40
    elif kind == "huge":
        x = x * 3e38
    elif kind == "special":
        pick = torch.rand(n, generator=gen)
        x[pick < 0.01] = NAN
        x[(pick >= 0.01) & (pick < 0.02)] = INF
        x[(pick >= 0.02) & (pick < 0.03)] = -INF
    elif kind == "constant":
        rows = x.view(-1, run)
        rows[::2] = rows[::2, :1]
        rows[1::3] = 0.0
        if rows.shape[0] > 2:
            rows[2, ::2] = -0.0
    return x


# -- rows centered on their offset -------------------------------------------------------------


def test_row_sum_adds_each_lane_in_order_in_float64() -> None:
    """The reference's ``cumsum`` over the lane-strided view is the sequential float64 sum
    the kernels reproduce: checked against a Python loop on values whose sum depends on
    the order."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(3, 100, generator=gen) * torch.logspace(-20, 20, 100)
    means = row_means_ref(rows)
    for r in range(3):
        lanes = [0.0] * SUM_LANES
        for j, v in enumerate(rows[r].tolist()):
            lanes[j % SUM_LANES] += v
        width = SUM_LANES // 2
        while width >= 1:
            lanes = [lanes[i] + lanes[i + width] for i in range(width)]
            width //= 2
        want = torch.tensor(lanes[0] / 100, dtype=torch.float64).float()
        assert_bits_equal(means[r : r + 1], want.reshape(1))


@pytest.mark.parametrize("scale", [False, True], ids=["centered", "scaled"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_center_parity(
    kernel: None, device: torch.device, dtype: torch.dtype, run: int, kind: str, scale: bool
) -> None:
    x = _data(9 * run, kind, run).to(dtype)
    got = row_center(x.to(device), run, scale=scale, impl="kernel")
    want = row_center_ref(x, run, scale)
    for g, w in zip(got, want):
        assert_bits_equal(torch.empty(0) if g is None else g, w)
    decoded = want[0] + torch.randn(want[0].shape) * 0.01
    for out in DTYPES:
        args = (want[1], want[2], want[3] if scale else None, run, out)
        restored = row_uncenter(decoded.to(device), *_on(device, args), impl="kernel")
        assert_bits_equal(restored, row_uncenter_ref(decoded, *args))


def _on(device: torch.device, args: tuple[object, ...]) -> tuple[object, ...]:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("group_size", [32, 100, 256])
@pytest.mark.parametrize("kind", ["plain", "mean", "special", "tiny", "constant"])
@pytest.mark.parametrize("run", [32, 100, 1024, 4100])
@pytest.mark.parametrize("bits", BITS)
def test_row_group_parity(
    kernel: None, device: torch.device, bits: int, run: int, kind: str, group_size: int
) -> None:
    """The fused ops are row_center + group_quantize and group_dequantize + row_uncenter,
    with codes that may straddle rows and groups that need not fit them."""
    for dtype in (torch.float32, torch.bfloat16):
        x = _data(3 * run, kind, run, seed=bits).to(dtype)
        for stochastic in (True, False):
            got = row_group_quantize(
                x.to(device), run, bits, group_size, seed=7, stochastic=stochastic, impl="kernel"
            )
            want = row_group_quantize_ref(x, run, bits, group_size, 7, stochastic)
            for g, w in zip(got, want):
                assert_bits_equal(g, w)
        restored = row_group_dequantize(
            *_on(device, want), bits, group_size, run, x.numel(), dtype, impl="kernel"
        )
        ref = row_group_dequantize_ref(*want, bits, group_size, run, x.numel(), dtype)
        assert_bits_equal(restored, ref)


@pytest.mark.parametrize("bits", BITS)
def test_row_group_seeded_overload_draws_what_the_int_seed_draws(
    kernel: None, device: torch.device, bits: int
) -> None:
    """``row_group_quantize.seeded`` (the seed a 0-dim int64 tensor, a compiled graph's: on
    the CPU, or on the data's device, read there by the kernel) gives the int seed's codes."""
    x = _data(3 * 100, "plain", 100, seed=bits)
    for seed in (7, 2**63 + 5):
        as_tensor = torch.tensor(seed - 2**64 if seed >= 2**63 else seed)
        want = row_group_quantize(x, 100, bits, 32, seed=seed, impl="kernel")
        for where in {torch.device("cpu"), device}:
            got = row_group_quantize(
                x.to(device), 100, bits, 32, seed=as_tensor.to(where), impl="kernel"
            )
            for g, w in zip(got, want, strict=True):
                assert_bits_equal(g.cpu(), w)


def test_row_ops_validate(kernels_on: None) -> None:
    x = torch.randn(10, 7)
    for impl in ("kernel", "ref"):
        with pytest.raises(ValueError, match="rows of 3"):
            row_center(x, 3, impl=impl)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        row_center(x.long(), 7)
    _, offsets, constant, _ = row_center(x, 7)
    with pytest.raises(TypeError, match="offsets"):
        torch.ops.torchstash.row_uncenter(
            x.view(-1), offsets[:-1], constant, offsets[:0], 7, x.dtype
        )


# -- e4m3 codes --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "special", "tiny", "huge", "mean"])
@pytest.mark.parametrize("group_size", [1, 3, 32, 256, 5000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_parity(
    kernel: None, device: torch.device, dtype: torch.dtype, group_size: int, kind: str
) -> None:
    for n in (1, 255, 70000):
        x = _data(n, kind, seed=n).to(dtype)
        codes, scale = fp8_quantize(x.to(device), group_size, impl="kernel")
        want_codes, want_scale = fp8_quantize_ref(x, group_size)
        assert_bits_equal(codes, want_codes)
        assert_bits_equal(scale, want_scale)
        for out in DTYPES:
            got = fp8_dequantize(codes[:n], scale, group_size, n, out, impl="kernel")
            assert_bits_equal(
                got, fp8_dequantize_ref(want_codes[:n], want_scale, group_size, n, out)
            )


def test_fp8_codes_are_torchs_cast(kernels_on: None) -> None:
    """With a scale of 1 (each group's largest magnitude 448), the codes of every float32 in
    [-448, 448] sampled by bit pattern are torch's float8_e4m3fn cast, and every code decodes
    as torch's float8 -> float32 conversion (both signs of NaN included)."""
    gen = torch.Generator().manual_seed(2)
    bits = torch.randint(0, 0x43E00001, (1 << 20,), generator=gen, dtype=torch.int64)
    x = (bits.to(torch.int32).view(torch.float32) * torch.where(bits % 2 == 0, 1.0, -1.0)).view(
        -1, 256
    )
    x[:, 0] = 448.0
    codes, scale = fp8_quantize(x, 256, impl="kernel")
    assert torch.equal(scale.float(), torch.ones_like(scale.float()))
    assert torch.equal(codes, x.reshape(-1).to(E4M3).view(torch.uint8))
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    one = torch.ones(1, dtype=torch.bfloat16)
    assert_bits_equal(fp8_dequantize(every, one, 256, 256, torch.float32), every.view(E4M3).float())


def test_fp8_saturates_where_the_scale_underflows(kernels_on: None) -> None:
    """A group of values near 1e-43 has a scale of 0: its quotients are infinite and code as
    448 (torch 2.10 on saturates; the clamp makes older torches agree)."""
    x = torch.tensor([1e-43, -1e-43, 1e-44, 0.0] * 64)
    codes, scale = fp8_quantize(x, 256, impl="kernel")
    assert scale.float().item() == 0.0
    assert codes[:3].tolist() == [0x7E, 0xFE, 0x7E]
    assert torch.equal(codes, fp8_quantize_ref(x, 256)[0])


def test_fp8_validates(kernels_on: None) -> None:
    x = torch.randn(300)
    with pytest.raises(ValueError, match="group_size"):
        fp8_quantize(x, 0)
    codes, scale = fp8_quantize(x, 256)
    assert codes.numel() == 512  # whole groups, as the codec always stored them
    with pytest.raises(ValueError, match="300 codes"):
        fp8_dequantize(codes, scale, 256, 300, torch.float32)
    with pytest.raises(TypeError, match="scale"):
        torch.ops.torchstash.fp8_dequantize(codes[:300], scale.float(), 256, 300, torch.float32)


# -- sign bits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 70001])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_sign_parity(kernel: None, device: torch.device, dtype: torch.dtype, n: int) -> None:
    x = _data(n, "special").to(dtype)
    x[:3] = torch.tensor([0.0, -0.0, -1e-30])[: min(3, n)]
    packed = sign_pack(x.to(device), impl="kernel")
    assert_bits_equal(packed, sign_pack_ref(x))
    got = sign_unpack(packed, n, dtype, impl="kernel").cpu()
    want = sign_unpack_ref(packed.cpu(), n, dtype)
    assert got.dtype == want.dtype and torch.equal(got, want)  # 1.0 and 0.0 only


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 17, 31, 33, 1000, 70001, 131075])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_sign_select_parity(kernels_on: None, dtype: torch.dtype, n: int) -> None:
    """Bit for bit its reference and a ReLU's ``threshold_backward``: the gradient's NaN, Inf
    and -0.0 pass where a bit is set; +0.0 elsewhere; a non-contiguous gradient is read in
    ``contiguous()`` order."""
    x = _data(n, "special").to(dtype)
    x[:3] = torch.tensor([0.0, -0.0, NAN])[: min(3, n)]
    g = _data(2 * n, "special", seed=1).to(dtype)[::2]
    g[:3] = torch.tensor([-0.0, NAN, -INF])[: min(3, n)]
    packed = sign_pack(x, impl="kernel")
    got = sign_select(g, packed, impl="kernel")
    assert_bits_equal(got, sign_select_ref(g, packed))
    assert_bits_equal(got, torch.ops.aten.threshold_backward(g, x, 0).reshape(-1))


def test_sign_select_says_what_it_cannot_take(kernels_on: None) -> None:
    g = torch.randn(10)
    with pytest.raises(TypeError, match="sign_select: grad must be a float tensor"):
        sign_select(g.int(), sign_pack(g))
    with pytest.raises(ValueError, match="sign_select"):
        sign_select(g, sign_pack(torch.randn(30)))
    with pytest.raises(TypeError, match="sign_select: packed must be uint8"):
        torch.ops.torchstash.sign_select(g, sign_pack(g).float())


def test_sign_pack_is_relus_backward_mask(kernels_on: None) -> None:
    """The bits are where ``x <= 0`` is false (NaN above zero), on a non-contiguous input
    read in ``x.contiguous()`` order."""
    x = torch.tensor([[1.0, -1.0, 0.0], [-0.0, NAN, 2.0], [INF, -INF, 1e-45]]).t()
    bits = sign_pack(x, impl="kernel")
    want = ~(x.contiguous() <= 0)
    assert torch.equal(sign_unpack(bits, 9, torch.float32).bool(), want.reshape(-1))


# -- torch.library -----------------------------------------------------------------------------


def test_opcheck(built: None) -> None:
    ops = torch.ops.torchstash
    x = torch.randn(6, 64)
    for xs in (x, x.bfloat16(), x.t()):
        torch.library.opcheck(ops.row_center.default, (xs, 32, True))
        torch.library.opcheck(ops.fp8_quantize.default, (xs, 100))
        torch.library.opcheck(ops.sign_pack.default, (xs,))
        torch.library.opcheck(ops.row_group_quantize.default, (xs, 64, 4, 32, 3, True))
        seed = torch.tensor(3)
        torch.library.opcheck(ops.row_group_quantize.seeded, (xs, 64, 4, 32, seed, True))
    centered, offsets, constant, scales = ops.row_center(x, 32, True)
    torch.library.opcheck(
        ops.row_uncenter.default, (centered, offsets, constant, scales, 32, torch.float16)
    )
    codes, scale = ops.fp8_quantize(x, 100)
    torch.library.opcheck(ops.fp8_dequantize.default, (codes[:384], scale, 100, 384, torch.float32))
    torch.library.opcheck(ops.sign_unpack.default, (ops.sign_pack(x), 384, torch.float64))
    for g in (x, x.bfloat16(), x.t()):
        torch.library.opcheck(ops.sign_select.default, (g, ops.sign_pack(x)))
    packed, lo, step, off, const = ops.row_group_quantize(x, 64, 2, 32, 3, True)
    torch.library.opcheck(
        ops.row_group_dequantize.default,
        (packed, lo, step, off, const, 2, 32, 64, 384, torch.bfloat16),
    )
