"""Compiled kernels against the pure-PyTorch references: bit-exact parity, layouts, edge cases.

Every parity test runs on CPU and (marked ``cuda``, skipped without a GPU) on CUDA,
always against the reference evaluated on CPU.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from torchstash import env
from torchstash.errors import KernelUnavailable
from torchstash.kernels import (
    Impl,
    loader,
    pack_bits,
    pack_mask,
    philox_uniform,
    unpack_bits,
    unpack_mask,
)
from torchstash.kernels.reference import (
    pack_bits_ref,
    philox4x32_10,
    philox_uniform_ref,
    unpack_bits_ref,
)

BITS = [1, 2, 4, 8]
IMPLS: tuple[Impl, ...] = ("kernel", "ref")
SIZES = [0, 1, 3, 7, 9, 1000003]
U64 = 2**64 - 1


def _codes(n: int, high: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, (n,), dtype=torch.uint8, generator=gen)


def _expected_len(n: int, bits: int) -> int:
    return -(-n * bits // 8)


# --------------------------------------------------------------------------- layout


def test_layout_by_hand() -> None:
    codes = torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_bits_ref(codes, 1).tolist() == [0b00001101, 0b00000001]
    assert pack_bits_ref(torch.tensor([3, 0, 1, 2, 1], dtype=torch.uint8), 2).tolist() == [
        3 | 1 << 4 | 2 << 6,
        1,
    ]
    assert pack_bits_ref(torch.tensor([0xA, 0x5, 0xF], dtype=torch.uint8), 4).tolist() == [
        0x5A,
        0x0F,
    ]
    assert unpack_bits_ref(torch.tensor([0x5A], dtype=torch.uint8), 4, 2).tolist() == [0xA, 0x5]


@pytest.mark.parametrize("bits", BITS)
def test_reference_matches_literal_definition(bits: int) -> None:
    codes = _codes(1001, seed=bits)
    packed = pack_bits_ref(codes, bits)
    per, mask = 8 // bits, (1 << bits) - 1
    expected = [0] * _expected_len(codes.numel(), bits)
    for i, c in enumerate(codes.tolist()):
        expected[i // per] |= (c & mask) << ((i % per) * bits)
    assert packed.tolist() == expected
    assert unpack_bits_ref(packed, bits, 1001).tolist() == [c & mask for c in codes.tolist()]


# --------------------------------------------------------------------------- bitpack parity


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_pack_parity(kernel: None, device: torch.device, bits: int, n: int) -> None:
    codes = _codes(n, seed=n + bits)  # all 8 bits random: the high bits must be dropped
    got = pack_bits(codes.to(device), bits, impl="kernel")
    assert got.dtype == torch.uint8 and got.shape == (_expected_len(n, bits),)
    assert got.device.type == device.type
    assert torch.equal(got.cpu(), pack_bits_ref(codes, bits))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_unpack_parity(kernel: None, device: torch.device, bits: int, n: int) -> None:
    packed = _codes(_expected_len(n, bits), seed=n * 7 + bits)  # garbage in the unused bits too
    got = unpack_bits(packed.to(device), bits, n, impl="kernel")
    assert got.dtype == torch.uint8 and got.shape == (n,)
    assert torch.equal(got.cpu(), unpack_bits_ref(packed, bits, n))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("impl", IMPLS)
def test_round_trip(kernel: None, device: torch.device, bits: int, n: int, impl: Impl) -> None:
    codes = _codes(n, high=2**bits, seed=n).to(device)
    packed = pack_bits(codes, bits, impl=impl)
    assert torch.equal(unpack_bits(packed, bits, n, impl=impl), codes)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_trailing_bits_are_zero(kernel: None, device: torch.device, bits: int) -> None:
    codes = torch.full((8 // bits + 1,), 255, dtype=torch.uint8, device=device)
    packed = pack_bits(codes, bits, impl="kernel").cpu()
    assert packed.tolist() == [255, (1 << bits) - 1]


@pytest.mark.parametrize("bits", BITS)
def test_non_contiguous_and_shaped_input(kernel: None, device: torch.device, bits: int) -> None:
    base = _codes(61 * 37, seed=bits).view(61, 37).to(device)
    for codes in (base.t(), base[:, ::3], base[::2].unsqueeze(0)):
        assert not codes.is_contiguous()
        expected = pack_bits_ref(codes.cpu().contiguous(), bits)
        assert torch.equal(pack_bits(codes, bits, impl="kernel").cpu(), expected)
        assert torch.equal(pack_bits(codes, bits, impl="ref").cpu(), expected)


def test_storage_offset_input(kernel: None, device: torch.device) -> None:
    codes = _codes(1003, high=4).to(device)[3:]  # contiguous, unaligned data pointer
    assert torch.equal(pack_bits(codes, 2, impl="kernel").cpu(), pack_bits_ref(codes.cpu(), 2))


@pytest.mark.parametrize("n", [0, 1, 9, 1000003])
def test_bool_masks(kernel: None, device: torch.device, n: int) -> None:
    mask = (_codes(n, seed=n) & 1).bool()
    expected = pack_bits_ref(mask.to(torch.uint8), 1)
    assert torch.equal(pack_bits_ref(mask, 1), expected)
    for impl in IMPLS:
        packed = pack_mask(mask.to(device), impl=impl)
        assert torch.equal(packed.cpu(), expected)
        back = unpack_mask(packed, n, impl=impl)
        assert back.dtype == torch.bool and torch.equal(back.cpu(), mask)
    strided = mask.view(-1, 1).expand(-1, 3).t()  # non-contiguous bool
    assert torch.equal(
        pack_mask(strided.to(device), impl="kernel").cpu(), pack_bits_ref(strided.contiguous(), 1)
    )


def test_empty_everything(kernel: None, device: torch.device) -> None:
    for bits in BITS:
        empty = torch.empty(0, 5, dtype=torch.uint8, device=device)
        for impl in IMPLS:
            packed = pack_bits(empty, bits, impl=impl)
            assert packed.shape == (0,) and packed.dtype == torch.uint8
            assert unpack_bits(packed, bits, 0, impl=impl).shape == (0,)
    assert philox_uniform(0, 1, device=device, impl="kernel").shape == (0,)
    assert philox_uniform_ref(0, 1).shape == (0,)


def test_results_do_not_depend_on_thread_count(kernels_on: None) -> None:
    codes = _codes(3_000_017, high=4)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = (
            pack_bits(codes, 2, impl="kernel"),
            philox_uniform(1_000_003, 9, 4, impl="kernel"),
        )
        torch.set_num_threads(max(2, old))
        multi = (pack_bits(codes, 2, impl="kernel"), philox_uniform(1_000_003, 9, 4, impl="kernel"))
    finally:
        torch.set_num_threads(old)
    assert all(torch.equal(a, b) for a, b in zip(single, multi))


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_clear_errors(kernels_on: None, impl: Impl) -> None:
    codes = _codes(10)
    with pytest.raises(ValueError, match=r"bits=3 .*allowed values are 1, 2, 4, 8"):
        pack_bits(codes, 3, impl=impl)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(codes, 0, 10, impl=impl)
    with pytest.raises(TypeError, match=r"uint8 or bool.*torch\.float32"):
        pack_bits(codes.float(), 2, impl=impl)
    with pytest.raises(ValueError, match="bool codes are packed at bits=1"):
        pack_bits(codes.bool(), 2, impl=impl)
    with pytest.raises(ValueError, match="need exactly 3 packed bytes, got 10"):
        unpack_bits(codes, 2, 10, impl=impl)
    with pytest.raises(ValueError, match="1-D"):
        unpack_bits(codes.view(2, 5), 8, 10, impl=impl)
    with pytest.raises(TypeError, match="packed must be uint8"):
        unpack_bits(codes.int(), 8, 10, impl=impl)
    with pytest.raises(ValueError, match="numel"):
        unpack_bits(codes, 8, -1, impl=impl)
    with pytest.raises(TypeError, match="bool tensor"):
        pack_mask(codes, impl=impl)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        philox_uniform(4, -1, impl=impl)
    with pytest.raises(ValueError, match="offset"):
        philox_uniform(4, 0, 2**64, impl=impl)


def test_invalid_impl() -> None:
    bad: Any = "fast"
    with pytest.raises(
        ValueError, match="impl='fast' is not valid; allowed values are auto, ref, kernel"
    ):
        pack_bits(_codes(4), 2, impl=bad)


def test_ops_validate_direct_calls(kernels_on: None) -> None:
    """The C++ checks guard torch.ops.torchstash.* callers that skip the Python layer."""
    ops = torch.ops.torchstash
    with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8"):
        ops.pack_bits(_codes(4), 3)
    with pytest.raises(TypeError, match="codes must be uint8 or bool"):
        ops.pack_bits(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="bool codes are packed at bits=1"):
        ops.pack_bits(torch.zeros(4, dtype=torch.bool), 4)
    with pytest.raises(ValueError, match="need exactly 2 packed bytes"):
        ops.unpack_bits(_codes(3), 4, 4)
    with pytest.raises(ValueError, match="numel must be >= 0"):
        ops.unpack_bits(_codes(0), 4, -1)
    with pytest.raises(TypeError, match="out must be float32"):
        ops.philox_uniform(torch.empty(4, dtype=torch.float64), 0, 0)
    with pytest.raises(ValueError, match="out must be contiguous"):
        ops.philox_uniform(torch.empty(4, 2).t(), 0, 0)


# --------------------------------------------------------------------------- philox

# Random123 kat_vectors: (counter words, key words) -> output words, in natural order.
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF,) * 4,
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("counter", "key", "expected"), KAT)
def test_philox_reference_known_answers(
    counter: tuple[int, int, int, int], key: tuple[int, int], expected: tuple[int, ...]
) -> None:
    words = tuple(torch.tensor([c], dtype=torch.int64) for c in counter)
    got = philox4x32_10(words, key)
    assert tuple(int(w) for w in got) == expected


def test_philox_kernel_known_answer(kernel: None, device: torch.device) -> None:
    # seed 0, offset 0, block 0 is the all-zero Random123 vector.
    expected = [(w >> 8) * 2.0**-24 for w in KAT[0][2]]
    got = philox_uniform(4, 0, 0, device=device, impl="kernel").cpu()
    assert got.tolist() == expected
    assert philox_uniform_ref(4, 0, 0).tolist() == expected


def test_philox_layout_uses_seed_and_offset_words() -> None:
    seed, offset = 0x299F31D0_A4093822, 0x03707344_13198A2E
    words = philox4x32_10(
        tuple(torch.tensor([w], dtype=torch.int64) for w in (0, 0, 0x13198A2E, 0x03707344)),
        (0xA4093822, 0x299F31D0),
    )
    expected = [(int(w) >> 8) * 2.0**-24 for w in words]
    assert philox_uniform_ref(4, seed, offset).tolist() == expected


def test_mulhilo_is_exact() -> None:
    from torchstash.kernels.reference import M0, M1, _mulhilo

    rng = random.Random(0)
    values = [0, 1, 0xFFFF, 0x10000, 0xFFFFFFFF, 0x80000000] + [
        rng.getrandbits(32) for _ in range(500)
    ]
    b = torch.tensor(values, dtype=torch.int64)
    for a in (M0, M1, 0xFFFFFFFF):
        hi, lo = _mulhilo(a, b)
        assert hi.tolist() == [(a * v) >> 32 for v in values]
        assert lo.tolist() == [(a * v) & 0xFFFFFFFF for v in values]


@pytest.mark.parametrize("n", [1, 3, 4, 5, 1001, 100003])
@pytest.mark.parametrize(
    ("seed", "offset"),
    [(0, 0), (1, 0), (123456789, 7), (2**32 + 5, 2**40 + 3), (U64, U64), (2**63, 1)],
)
def test_philox_parity(kernel: None, device: torch.device, n: int, seed: int, offset: int) -> None:
    got = philox_uniform(n, seed, offset, device=device, impl="kernel")
    assert got.dtype == torch.float32 and got.shape == (n,) and got.device.type == device.type
    assert torch.equal(got.cpu(), philox_uniform_ref(n, seed, offset))


@pytest.mark.parametrize("n", [*range(1, 41), 4095, 4097, 65535, 2 * 65536 + 3])
def test_philox_op_writes_exactly_its_out(kernel: None, device: torch.device, n: int) -> None:
    """Into a view of a larger buffer with unaligned start: nothing outside it changes."""
    buf = torch.full((n + 17,), -1.0, device=device)
    torch.ops.torchstash.philox_uniform(buf[1 : n + 1], 77, 3)
    assert torch.equal(buf[1 : n + 1].cpu(), philox_uniform_ref(n, 77, 3))
    assert float(buf[0]) == -1.0 and bool((buf[n + 1 :] == -1.0).all())


def test_philox_uniformity(kernel: None, device: torch.device) -> None:
    u = philox_uniform(1_000_000, 42, 0, device=device, impl="kernel").cpu().double()
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 3e-3  # ~10 standard errors
    assert abs(float(u.var()) - 1 / 12) < 2e-3
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float((counts - 100_000).abs().max()) < 5_000
    assert (u * 2**24).frac().abs().max() == 0  # 24-bit grid: exact in float32


def test_philox_prefix_and_streams(kernel: None, device: torch.device) -> None:
    """Element i depends only on (seed, offset, i): a draw is a prefix of any longer one;
    ``offset`` (the counter's high words) and ``seed`` select independent streams."""
    big = philox_uniform(4099, 5, 11, device=device, impl="kernel")
    for n in (1, 2, 3, 4, 5, 8, 4097):
        assert torch.equal(philox_uniform(n, 5, 11, device=device, impl="kernel"), big[:n])
    assert torch.equal(philox_uniform(4099, 5, 11, device=device, impl="kernel"), big)
    others = [
        philox_uniform(4099, 5, 12, device=device, impl="kernel"),
        philox_uniform(4099, 6, 11, device=device, impl="kernel"),
        philox_uniform(4099, 5, 11 + 2**32, device=device, impl="kernel"),
    ]
    for other in others:
        assert float((other == big).float().mean()) < 0.01


def test_philox_default_offset_and_device() -> None:
    assert torch.equal(philox_uniform(10, 3, impl="ref"), philox_uniform_ref(10, 3, 0))
    assert philox_uniform(10, 3, impl="ref").device == torch.device("cpu")


# --------------------------------------------------------------------------- torch.library


@pytest.mark.parametrize("bits", BITS)
def test_opcheck_pack_unpack(built: None, bits: int) -> None:
    codes = _codes(37, high=2**bits)
    torch.library.opcheck(torch.ops.torchstash.pack_bits.default, (codes, bits))
    torch.library.opcheck(torch.ops.torchstash.pack_bits.default, (codes.view(37, 1).t(), bits))
    packed = torch.ops.torchstash.pack_bits(codes, bits)
    torch.library.opcheck(torch.ops.torchstash.unpack_bits.default, (packed, bits, 37))


def test_opcheck_bool_and_philox(built: None) -> None:
    torch.library.opcheck(torch.ops.torchstash.pack_bits.default, (torch.rand(5, 3) > 0.5, 1))
    torch.library.opcheck(torch.ops.torchstash.philox_uniform.default, (torch.empty(10), 1, 2))


def test_torch_compile_traces_the_ops(built: None) -> None:
    def roundtrip(codes: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.torchstash.pack_bits(codes, 2)
        out = torch.empty(codes.numel())
        torch.ops.torchstash.philox_uniform(out, 7, 1)
        return torch.ops.torchstash.unpack_bits(packed, 2, codes.numel()) + (out < 2).to(
            torch.uint8
        )

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    codes = _codes(101, high=4)
    assert torch.equal(compiled(codes), codes + 1)


# --------------------------------------------------------------------------- large inputs


@pytest.mark.slow
def test_pack_unpack_beyond_int32_elements(
    kernel: None, device: torch.device, request: pytest.FixtureRequest
) -> None:
    """2**31 + 8205 one-bit codes: the indices past 2**31 must land in the right bytes."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow (about 4 GiB of memory): run with -m slow")
    n = 2**31 + 8205
    codes = torch.zeros(n, dtype=torch.uint8, device=device)
    tail = _codes(4099, high=2).to(device)
    codes[-4099:] = tail
    codes[2**31 - 5 : 2**31 + 3] = 1  # straddles 2**31
    packed = pack_bits(codes, 1, impl="kernel")
    assert packed.numel() == _expected_len(n, 1)
    lo = (2**31 - 8) // 8
    assert packed[lo : lo + 2].tolist() == [0b11111000, 0b00000111]
    first = (n - 4099) // 8
    assert torch.equal(packed[first:].cpu(), pack_bits_ref(codes[first * 8 :].cpu(), 1))
    del codes
    back = unpack_bits(packed, 1, n, impl="kernel")
    assert torch.equal(back[-4099:], tail)
    assert back[2**31 - 6 : 2**31 + 4].tolist() == [0] + [1] * 8 + [0]
    assert not bool(back[: 2**31 - 5].any())


# --------------------------------------------------------------------------- dispatch


def test_kernel_path_is_the_compiled_op(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchstash.kernels.bitpack as bitpack_mod

    calls: list[int] = []

    def spy(codes: torch.Tensor, bits: int) -> torch.Tensor:
        calls.append(bits)
        return pack_bits_ref(codes, bits)

    monkeypatch.setattr(bitpack_mod, "pack_bits_ref", spy)
    pack_bits(_codes(9), 2)
    assert calls == []
    pack_bits(_codes(9), 2, impl="ref")
    assert calls == [2]


def test_off_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchstash.kernels.bitpack as bitpack_mod
    import torchstash.kernels.philox as philox_mod

    calls: list[str] = []

    def spy_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
        calls.append("pack")
        return pack_bits_ref(codes, bits)

    def spy_philox(
        numel: int, seed: int, offset: int = 0, *, device: object = "cpu"
    ) -> torch.Tensor:
        calls.append("philox")
        return philox_uniform_ref(numel, seed, offset)

    monkeypatch.setenv(env.KERNELS, "off")
    monkeypatch.setattr(bitpack_mod, "pack_bits_ref", spy_pack)
    monkeypatch.setattr(philox_mod, "philox_uniform_ref", spy_philox)
    assert not loader.available("cpu")
    assert torch.equal(pack_bits(_codes(9, high=4), 2), pack_bits_ref(_codes(9, high=4), 2))
    philox_uniform(5, 1)
    assert calls == ["pack", "philox"]
    with pytest.raises(KernelUnavailable, match="TORCHSTASH_KERNELS=off"):
        pack_bits(_codes(9), 2, impl="kernel")
    assert loader.status()["mode"] == "off"


def test_bench_smoke(kernels_on: None) -> None:
    from torchstash.kernels import bench

    rows = bench.run(mib=0.25, repeat=1)
    assert [(r.op, r.bits) for r in rows] == [
        *((op, bits) for bits in BITS for op in ("pack_bits", "unpack_bits")),
        ("philox_uniform", None),
    ]
    assert all(r.ref_ms > 0 and r.kernel_ms > 0 and r.speedup > 0 for r in rows)
    assert [r.bits for r in rows if r.copy] == [8, 8]
    assert bench.failures(rows, 1e9) == [r for r in rows if not r.copy]
    assert "philox_uniform" in bench.format_table(rows)


@pytest.mark.cuda
def test_bench_times_every_suite_on_cuda(kernels_on: None) -> None:
    """``--device cuda`` (what scripts/gpu-check runs): every suite's case on the GPU."""
    from torchstash.kernels import bench

    rows = bench.run(mib=0.25, repeat=1, suites=bench.SUITES, device="cuda")
    assert {r.op for r in rows} >= {"pack_bits", "group_quantize", "channel_quantize", "topk_mask"}
    assert all(r.ref_ms > 0 and r.kernel_ms > 0 for r in rows)
    assert bench.main(["--mib", "0.25", "--repeat", "1", "--device", "cuda"]) == 0
