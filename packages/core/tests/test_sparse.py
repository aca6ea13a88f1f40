"""Top-k selection by magnitude and sparse storage: the kernels against the reference bit for
bit, the spec's edge cases (ties, NaN/Inf, segments sharing bytes), round trips, validation
and torch.library.

Every parity test runs on CPU and (marked ``cuda``, skipped without a GPU) on CUDA, always
against the reference evaluated on CPU. The host-compiled check at the end runs sparse.h's
keys and radix-select step, the ones the CUDA kernels call, against the reference.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from torchstash import env
from torchstash.errors import KernelUnavailable
from torchstash.kernels import (
    OFFSET_BLOCK,
    Impl,
    mask_compact,
    mask_offsets,
    mask_scatter,
    offsets_scatter,
    pack_mask,
    topk_mask,
    unpack_mask,
)
from torchstash.kernels.sparse_reference import (
    magnitude_keys,
    mask_compact_ref,
    mask_offsets_ref,
    mask_scatter_ref,
    offsets_scatter_ref,
    topk_mask_ref,
)
from torchstash.testing.bits import INT_VIEW, assert_bits_equal
from torchstash.testing.native import build_host_program, run_host_program

from ._helpers import DTYPES, IMPLS, INF, NAN, assert_bad_impl_refused, spy_on

KINDS = ["randn", "rounded", "zeros", "special"]

# (segments, length): one element, one short and one long segment (more than one offset
# block, and split across threads on CPU), rows of odd lengths whose bits share bytes with
# the next row's, rows shorter than a byte, many short rows, and a few long rows.
LAYOUTS = [
    (1, 1),
    (1, 1000),
    (1, 200_000),
    (3, 37),
    (64, 37),
    (11, 3),
    (5, 8),
    (257, 64),
    (7, 4099),
    (2, 70_001),
]
LAYOUT_IDS = [f"{s}x{n}" for s, n in LAYOUTS]


def _data(n: int, kind: str, seed: int) -> torch.Tensor:
    """float32 (n,): ``randn`` (scaled over many binades), ``rounded`` (few distinct values:
    ties everywhere), ``zeros`` (+0.0 and -0.0, one key), ``special`` (NaN, +-Inf and zeros
    among rounded values)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "zeros":
        x = torch.zeros(n)
        x[torch.rand(n, generator=gen) < 0.5] = -0.0
        return x
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 3)
    if kind == "randn":
        return x
    x = torch.randn(n, generator=gen).mul(2).round()
    if kind == "special":
        u = torch.rand(n, generator=gen)
        x[u < 0.05] = NAN
        x[(u >= 0.05) & (u < 0.08)] = INF
        x[(u >= 0.08) & (u < 0.11)] = -INF
        x[(u >= 0.11) & (u < 0.12)] = -NAN
        x[(u >= 0.12) & (u < 0.3)] = -0.0
    return x


def _ks(length: int) -> list[int]:
    return sorted({0, 1, length // 3, length // 2, max(0, length - 1), length})


def check_roundtrips(device: torch.device, x: torch.Tensor, mask: torch.Tensor, kept: int) -> None:
    """mask_compact, mask_scatter, mask_offsets and offsets_scatter on ``device`` against the
    reference on CPU, for x (CPU) and its mask (CPU)."""
    n = x.numel()
    values = mask_compact_ref(x, mask, kept)
    xd, md = x.to(device), mask.to(device)
    got = mask_compact(xd, md, kept, impl="kernel")
    assert got.device.type == device.type
    assert_bits_equal(got, values)
    dense = mask_scatter(md, got, n, impl="kernel")
    assert_bits_equal(dense, mask_scatter_ref(mask, values, n))
    offsets, counts = mask_offsets(md, n, kept, impl="kernel")
    want_offsets, want_counts = mask_offsets_ref(mask, n, kept)
    assert offsets.dtype == torch.uint16 and counts.dtype == torch.int32
    assert torch.equal(offsets.cpu(), want_offsets) and torch.equal(counts.cpu(), want_counts)
    assert_bits_equal(offsets_scatter(offsets, counts, got, n, impl="kernel"), dense.cpu())


def check_topk(
    device: torch.device, x: torch.Tensor, segments: int, k: int, exact: bool = True
) -> torch.Tensor:
    """topk_mask on ``device`` against the reference on CPU; the round trips of its mask.
    Returns the reference mask."""
    want = topk_mask_ref(x, segments, k, exact)
    got = topk_mask(x.to(device), segments, k, exact=exact, impl="kernel")
    assert got.device.type == device.type
    assert_bits_equal(got, want)
    check_roundtrips(device, x.contiguous().view(-1), want, segments * k if x.numel() else 0)
    return want


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "coarse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_parity(
    kernel: None,
    device: torch.device,
    dtype: torch.dtype,
    exact: bool,
    layout: tuple[int, int],
    kind: str,
) -> None:
    segments, length = layout
    x = _data(segments * length, kind, seed=segments + length).to(dtype)
    for k in _ks(length):
        check_topk(device, x, segments, k, exact)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ties_keep_the_lower_index(kernel: None, device: torch.device, dtype: torch.dtype) -> None:
    """Equal magnitudes (signs and NaN payloads aside) go to the lower flat index, also
    across the bytes and CPU threads of one long segment."""
    n = 3 * OFFSET_BLOCK + 5
    x = torch.zeros(n)
    x[::7] = 2.0
    x[3::7] = -2.0
    x[n // 2] = 5.0
    x = x.to(dtype)
    for k in (1, 2, 1000, n // 7, n // 5, n - 1):
        want = check_topk(device, x, 1, k)
        bits = unpack_mask(want, n)
        chosen = bits.nonzero().view(-1)
        if k > 1:
            assert chosen[0].item() == 0 and bits[n // 2]
    x = torch.tensor([-0.0, 0.0, 1.0, -1.0, 1.0, NAN, -NAN, INF, -INF, 3.0]).to(dtype)
    mask = unpack_mask(topk_mask(x.to(device), 1, 5, impl="kernel").cpu(), 10)
    assert mask.tolist() == [False] * 5 + [True] * 5  # NaN, -NaN, Inf, -Inf, 3
    mask = unpack_mask(topk_mask(x.to(device), 1, 6, impl="kernel").cpu(), 10)
    assert mask.tolist() == [False, False, True] + [False] * 2 + [True] * 5
    mask = unpack_mask(topk_mask(x.to(device), 1, 2, impl="kernel").cpu(), 10)
    assert mask.tolist() == [False] * 5 + [True, True] + [False] * 3  # NaN ranks above Inf


def test_exact_false_ranks_at_bfloat16_precision(kernel: None, device: torch.device) -> None:
    # Magnitudes that differ only below bfloat16's precision tie with exact=False.
    x = torch.tensor([1.0, 1.0 + 2**-20, -(1.0 + 2**-6), 1.0 + 2**-21, 0.5])
    exact = unpack_mask(topk_mask(x.to(device), 1, 2, impl="kernel").cpu(), 5)
    coarse = unpack_mask(topk_mask(x.to(device), 1, 2, exact=False, impl="kernel").cpu(), 5)
    assert exact.tolist() == [False, True, True, False, False]
    assert coarse.tolist() == [True, False, True, False, False]
    for exact_ in (True, False):
        check_topk(device, x, 1, 2, exact_)
    assert torch.equal(magnitude_keys(x, False), magnitude_keys(x) >> 16)


def test_results_do_not_depend_on_thread_count(kernels_on: None) -> None:
    """The CPU kernel splits few long segments across threads (ties counted per chunk) and
    many short ones into tasks of whole segments: the same bits either way."""
    old = torch.get_num_threads()
    cases = [
        (_data(300_001, "rounded", seed=1), 1),
        (_data(3 * 150_000, "zeros", seed=2), 3),
        (_data(2 * 131_072, "special", seed=3).bfloat16(), 2),
        (_data(999 * 37, "rounded", seed=4), 999),
    ]
    try:
        for x, segments in cases:
            length = x.numel() // segments
            for k in (1, length // 3, length - 2):
                outs = []
                for threads in (1, 2, 5):
                    torch.set_num_threads(threads)
                    outs.append(topk_mask(x, segments, k, impl="kernel"))
                assert_bits_equal(outs[0], topk_mask_ref(x, segments, k))
                for out in outs[1:]:
                    assert torch.equal(out, outs[0])
                kept = segments * k
                assert_bits_equal(
                    mask_compact(x, outs[0], kept, impl="kernel"),
                    mask_compact_ref(x, outs[0], kept),
                )
    finally:
        torch.set_num_threads(old)


# --------------------------------------------------------------------------- storage ops


def test_roundtrip_restores_the_kept_values(kernel: None, device: torch.device) -> None:
    for dtype in DTYPES:
        x = _data(5 * 40_000, "special", seed=7).to(dtype).view(5, 200, 200)
        k = 1234
        mask = topk_mask(x.to(device), 5, k, impl="kernel")
        values = mask_compact(x.to(device), mask, 5 * k, impl="kernel")
        assert values.shape == (5 * k,) and values.dtype == dtype
        dense = mask_scatter(mask, values, x.numel(), impl="kernel").cpu()
        bits = unpack_mask(mask.cpu(), x.numel())
        flat = x.reshape(-1)
        assert_bits_equal(dense[bits], flat[bits])
        assert not bool(dense[~bits].view(INT_VIEW[dtype]).any())  # +0.0 elsewhere
        offsets, counts = mask_offsets(mask, x.numel(), 5 * k, impl="kernel")
        assert int(counts.sum()) == 5 * k and counts.numel() == -(-x.numel() // OFFSET_BLOCK)
        assert_bits_equal(offsets_scatter(offsets, counts, values, x.numel(), impl="kernel"), dense)


@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_storage_ops_on_any_mask(kernel: None, device: torch.device, density: float) -> None:
    """Masks that topk_mask would not make: empty, sparse, dense, full; sizes around the
    offset block and the kernels' chunks."""
    gen = torch.Generator().manual_seed(int(density * 1000))
    for n in (
        1,
        7,
        8,
        9,
        64,
        65,
        4095,
        OFFSET_BLOCK - 1,
        OFFSET_BLOCK,
        OFFSET_BLOCK + 1,
        3 * OFFSET_BLOCK + 77,
    ):
        bits = torch.rand(n, generator=gen) < density
        mask = pack_mask(bits)
        x = _data(n, "special", seed=n)
        for dtype in DTYPES:
            check_roundtrips(device, x.to(dtype), mask, int(bits.sum()))


def test_trailing_mask_bits_are_ignored(kernel: None, device: torch.device) -> None:
    """Bits past numel in the last byte (never set by topk_mask) do not count."""
    x = torch.arange(1.0, 12.0)  # 11 elements: 5 unused bits in byte 1
    mask = torch.tensor([0b1000_0001, 0b1111_1100], dtype=torch.uint8)  # elements 0, 7, 10
    for impl in IMPLS:
        md = mask.to(device) if impl == "kernel" else mask
        xd = x.to(device) if impl == "kernel" else x
        values = mask_compact(xd, md, 3, impl=impl)
        assert values.cpu().tolist() == [1.0, 8.0, 11.0]
        offsets, counts = mask_offsets(md, 11, 3, impl=impl)
        assert offsets.cpu().tolist() == [0, 7, 10] and counts.cpu().tolist() == [3]
        dense = mask_scatter(md, values, 11, impl=impl).cpu()
        assert dense.tolist() == [1.0] + [0.0] * 6 + [8.0, 0.0, 0.0, 11.0]


@pytest.mark.parametrize("impl", IMPLS)
def test_empty(kernel: None, device: torch.device, impl: Impl) -> None:
    for shape, segments in [((0,), 1), ((0, 5), 5), ((3, 0, 2), 3)]:
        x = torch.empty(shape, device=device)
        mask = topk_mask(x, segments, 0, impl=impl)
        assert mask.shape == (0,) and mask.dtype == torch.uint8 and mask.device.type == device.type
        assert mask_compact(x, mask, 0, impl=impl).shape == (0,)
        for dtype in DTYPES:
            values = torch.empty(0, dtype=dtype, device=device)
            out = mask_scatter(mask, values, 0, impl=impl)
            assert out.shape == (0,) and out.dtype == dtype
            offsets, counts = mask_offsets(mask, 0, 0, impl=impl)
            assert offsets.shape == (0,) and counts.shape == (0,)
            assert offsets_scatter(offsets, counts, values, 0, impl=impl).shape == (0,)
    x = torch.randn(4, 6, device=device)
    assert not bool(topk_mask(x, 4, 0, impl=impl).any())  # k = 0: nothing
    full = topk_mask(x, 2, 12, impl=impl)  # k = L: everything
    assert full.cpu().tolist() == [255, 255, 255]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(kernel: None, device: torch.device, dtype: torch.dtype) -> None:
    """Any strides: the values of x.contiguous(), in its row-major order."""
    # the views are taken on the device: .to() would make a strided slice contiguous
    base = _data(2 * 6 * 17 * 19, "rounded", seed=4).view(2, 6, 17, 19).to(device, dtype)
    views = [
        (base.to(memory_format=torch.channels_last), 12),
        (base.transpose(1, 3), 2 * 19),
        (base[:, :, ::2], 2),
        (base.view(12, 323).t()[5:], 318),
    ]
    for x, segments in views:
        assert not x.is_contiguous()
        dense = x.cpu().contiguous()
        length = dense.numel() // segments
        for k in (1, length // 4):
            want = topk_mask_ref(dense, segments, k)
            assert_bits_equal(topk_mask(x, segments, k, impl="kernel"), want)
            got = mask_compact(x, want.to(device), segments * k, impl="kernel")
            assert_bits_equal(got, mask_compact_ref(dense, want, segments * k))


def test_unaligned_inputs(kernel: None, device: torch.device) -> None:
    """Tensors at an odd storage offset: a mask view one byte in, values two bytes in."""
    x = _data(17 * 59, "randn", seed=9)
    n, kept = x.numel(), 17 * 20
    mask = topk_mask_ref(x, 17, 20)
    shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), mask]).to(device)[1:]
    xs = torch.cat([torch.zeros(3), x]).to(device)[3:]
    assert_bits_equal(topk_mask(xs, 17, 20, impl="kernel"), mask)
    values = mask_compact(xs, shifted, kept, impl="kernel")
    assert_bits_equal(values, mask_compact_ref(x, mask, kept))
    hv = torch.cat([torch.zeros(1, dtype=torch.float16), values.cpu().half()]).to(device)[1:]
    assert_bits_equal(
        mask_scatter(shifted, hv, n, impl="kernel"), mask_scatter_ref(mask, hv.cpu(), n)
    )
    offsets, counts = mask_offsets(shifted, n, kept, impl="kernel")
    assert torch.equal(offsets.cpu(), mask_offsets_ref(mask, n, kept)[0])
    assert_bits_equal(
        offsets_scatter(offsets, counts, hv, n, impl="kernel"),
        offsets_scatter_ref(offsets.cpu(), counts.cpu(), hv.cpu(), n),
    )


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_clear_errors(kernels_on: None, impl: Impl) -> None:
    x = torch.randn(4, 6)
    mask = topk_mask(x, 4, 2, impl=impl)
    values = mask_compact(x, mask, 8, impl=impl)
    offsets, counts = mask_offsets(mask, 24, 8, impl=impl)
    not_a_tensor: Any = [1.0]
    not_a_bool: Any = 1
    with pytest.raises(TypeError, match=r"x must be one of float32, float16, bfloat16.*float64"):
        topk_mask(x.double(), 4, 2, impl=impl)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        topk_mask(not_a_tensor, 1, 1, impl=impl)
    with pytest.raises(ValueError, match=r"segments must be an int >= 1, got 0"):
        topk_mask(x, 0, 1, impl=impl)
    with pytest.raises(ValueError, match=r"k must be an int >= 0, got -1"):
        topk_mask(x, 4, -1, impl=impl)
    with pytest.raises(ValueError, match=r"24 elements do not split into 5 equal segments"):
        topk_mask(x, 5, 1, impl=impl)
    with pytest.raises(ValueError, match=r"k=7 is more than a segment's 6 elements"):
        topk_mask(x, 4, 7, impl=impl)
    with pytest.raises(TypeError, match="exact must be a bool"):
        topk_mask(x, 4, 1, exact=not_a_bool, impl=impl)
    with pytest.raises(ValueError, match=r"24 codes at 1 bits need exactly 3 packed bytes, got 2"):
        mask_compact(x, mask[:2], 8, impl=impl)
    with pytest.raises(TypeError, match="packed must be uint8"):
        mask_compact(x, mask.to(torch.int8), 8, impl=impl)
    with pytest.raises(ValueError, match=r"the mask has 8 set bits, not 9"):
        mask_compact(x, mask, 9, impl=impl)
    with pytest.raises(ValueError, match=r"kept must be an int >= 0"):
        mask_compact(x, mask, -1, impl=impl)
    with pytest.raises(ValueError, match="values must be 1-D"):
        mask_scatter(mask, values.view(2, 4), 24, impl=impl)
    with pytest.raises(TypeError, match="values must be one of float32"):
        mask_scatter(mask, values.int(), 24, impl=impl)
    with pytest.raises(ValueError, match="numel must be an int >= 0"):
        mask_scatter(mask, values, -3, impl=impl)
    with pytest.raises(ValueError, match=r"the mask has 8 set bits, not 7"):
        mask_offsets(mask, 24, 7, impl=impl)
    with pytest.raises(TypeError, match="offsets must be 1-D uint16"):
        offsets_scatter(offsets.int(), counts, values, 24, impl=impl)
    with pytest.raises(TypeError, match=r"counts must be int32 of shape \(1,\)"):
        offsets_scatter(offsets, counts.long(), values, 24, impl=impl)
    with pytest.raises(ValueError, match="8 offsets need as many 1-D values"):
        offsets_scatter(offsets, counts, values[:5], 24, impl=impl)


def test_invalid_impl() -> None:
    assert_bad_impl_refused(topk_mask, torch.ones(3), 1, 1)


def test_ops_validate_direct_calls(kernels_on: None) -> None:
    """The C++ checks guard torch.ops.torchstash.* callers that skip the Python layer."""
    ops = torch.ops.torchstash
    x = torch.randn(24)
    mask = ops.topk_mask(x, 4, 2, True)
    values = ops.mask_compact(x, mask, 8)
    offsets, counts = ops.mask_offsets(mask, 24, 8)
    with pytest.raises(TypeError, match="topk_mask: x must be float32, float16 or bfloat16"):
        ops.topk_mask(x.double(), 4, 2, True)
    with pytest.raises(ValueError, match="topk_mask: segments must be >= 1"):
        ops.topk_mask(x, 0, 2, True)
    with pytest.raises(ValueError, match="topk_mask: k must be >= 0"):
        ops.topk_mask(x, 4, -2, True)
    with pytest.raises(ValueError, match="24 elements do not split into 5 equal segments"):
        ops.topk_mask(x, 5, 1, True)
    with pytest.raises(ValueError, match="k=7 is more than a segment's 6 elements"):
        ops.topk_mask(x, 4, 7, True)
    with pytest.raises(
        ValueError, match="mask_compact: 24 codes at 1 bits need exactly 3 packed bytes"
    ):
        ops.mask_compact(x, mask[:2], 8)
    with pytest.raises(ValueError, match="mask_compact: the mask has 8 set bits, not 5"):
        ops.mask_compact(x, mask, 5)
    with pytest.raises(ValueError, match="mask_compact: kept must be >= 0"):
        ops.mask_compact(x, mask, -1)
    with pytest.raises(ValueError, match="mask_scatter: the mask has 8 set bits, but 7 values"):
        ops.mask_scatter(mask, values[:7], 24)
    with pytest.raises(ValueError, match="mask_scatter: values must be 1-D"):
        ops.mask_scatter(mask, values.view(2, 4), 24)
    with pytest.raises(ValueError, match="mask_offsets: the mask has 8 set bits, not 9"):
        ops.mask_offsets(mask, 24, 9)
    with pytest.raises(TypeError, match="offsets_scatter: offsets must be 1-D uint16"):
        ops.offsets_scatter(offsets.int(), counts, values, 24)
    with pytest.raises(TypeError, match=r"offsets_scatter: counts must be int32 of shape \(1,\)"):
        ops.offsets_scatter(offsets, counts.view(1, 1), values, 24)
    with pytest.raises(ValueError, match="offsets_scatter: counts must be >= 0 and sum to the 8"):
        ops.offsets_scatter(offsets, counts - 1, values, 24)
    with pytest.raises(ValueError, match="an offset of the last block reaches past 20 elements"):
        ops.offsets_scatter(offsets, counts, values, 20)
    with pytest.raises(ValueError, match="8 offsets need as many values, got 6"):
        ops.offsets_scatter(offsets, counts, values[:6], 24)


# --------------------------------------------------------------------------- torch.library


def test_opcheck(built: None) -> None:
    ops = torch.ops.torchstash
    x = torch.randn(6, 37)
    for xs, segments, k in ((x, 6, 5), (x.half().t(), 37, 2), (x.bfloat16(), 1, 100)):
        for exact in (True, False):
            torch.library.opcheck(ops.topk_mask.default, (xs, segments, k, exact))
        mask = ops.topk_mask(xs, segments, k, True)
        kept = segments * k
        torch.library.opcheck(ops.mask_compact.default, (xs, mask, kept))
        values = ops.mask_compact(xs, mask, kept)
        torch.library.opcheck(ops.mask_scatter.default, (mask, values, xs.numel()))
        torch.library.opcheck(ops.mask_offsets.default, (mask, xs.numel(), kept))
        offsets, counts = ops.mask_offsets(mask, xs.numel(), kept)
        torch.library.opcheck(ops.offsets_scatter.default, (offsets, counts, values, xs.numel()))


def test_torch_compile_traces_the_ops(built: None) -> None:
    def roundtrip(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = torch.ops.torchstash.topk_mask(x, 8, 5, True)
        values = torch.ops.torchstash.mask_compact(x, mask, 40)
        offsets, counts = torch.ops.torchstash.mask_offsets(mask, x.numel(), 40)
        dense = torch.ops.torchstash.mask_scatter(mask, values, x.numel())
        again = torch.ops.torchstash.offsets_scatter(offsets, counts, values, x.numel())
        return dense, again

    compiled = torch.compile(roundtrip, backend="aot_eager", fullgraph=True)
    x = torch.randn(8, 4, 16)
    for got, want in zip(compiled(x), roundtrip(x)):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- dispatch


def test_kernel_path_is_the_compiled_op(kernels_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import torchstash.kernels.sparse as sp_mod

    names = (
        "topk_mask_ref",
        "mask_compact_ref",
        "mask_scatter_ref",
        "mask_offsets_ref",
        "offsets_scatter_ref",
    )
    calls = spy_on(monkeypatch, sp_mod, names)
    x = torch.randn(4, 8)
    impls: tuple[Impl, ...] = ("auto", "ref")
    for impl in impls:
        mask = topk_mask(x, 4, 3, impl=impl)
        values = mask_compact(x, mask, 12, impl=impl)
        mask_scatter(mask, values, 32, impl=impl)
        offsets, counts = mask_offsets(mask, 32, 12, impl=impl)
        offsets_scatter(offsets, counts, values, 32, impl=impl)
    assert calls == list(names)


def test_off_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.KERNELS, "off")
    x = _data(7 * 11, "rounded", seed=1)
    assert torch.equal(topk_mask(x, 7, 4), topk_mask_ref(x, 7, 4))
    with pytest.raises(KernelUnavailable, match="TORCHSTASH_KERNELS=off"):
        topk_mask(x, 7, 4, impl="kernel")


def test_bench_smoke(kernels_on: None) -> None:
    from torchstash.kernels import bench

    rows = bench.run(mib=0.25, repeat=1, suites=("sparse",))
    assert {r.op for r in rows} == {
        "topk_mask",
        "mask_compact",
        "mask_scatter",
        "mask_offsets",
        "offsets_scatter",
    }
    assert all(r.ref_ms > 0 and r.kernel_ms > 0 for r in rows)
    # only offsets_scatter, write-bound on both sides, is left out of the --check gate
    assert {r.op for r in rows if r.copy} == {"offsets_scatter"}
    assert "topk_mask" in bench.format_table(rows)


# --------------------------------------------------------------------------- large inputs


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


@pytest.mark.slow
def test_beyond_int32_elements(
    kernel: None, device: torch.device, request: pytest.FixtureRequest
) -> None:
    """2**31 + 24 float16 elements, one segment: zeros and a few known large values past
    2**31, so the answer is known without the reference's sort. About 4.5 GiB."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow (about 4.5 GiB of memory): run with -m slow")
    if device.type == "cpu" and _available_memory() < 8 * 2**30:
        pytest.skip("needs about 8 GiB of free memory")
    n = 2**31 + 24
    x = torch.zeros(n, dtype=torch.float16, device=device)
    where = torch.tensor([5, 2**31 - 1, 2**31, 2**31 + 3, n - 1], device=device)
    x[where] = torch.tensor([1.0, -2.0, 3.0, NAN, INF], dtype=torch.float16, device=device)
    mask = topk_mask(x, 1, 8, impl="kernel")  # the 5 values and the first 3 zeros
    bits = mask.cpu()
    assert bits.numel() == n // 8
    assert bits[0].item() == 0b0010_0111 and not bool(bits[1 : 2**28 - 1].any())
    assert (
        bits[2**28 - 1].item() == 0x80 and bits[2**28].item() == 0b1001 and bits[-1].item() == 0x80
    )
    values = mask_compact(x, mask, 8, impl="kernel").cpu().float()
    assert values[:6].tolist() == [0.0, 0.0, 0.0, 1.0, -2.0, 3.0] and values[7].item() == INF
    offsets, counts = mask_offsets(mask, n, 8, impl="kernel")
    assert int(counts.sum()) == 8 and counts[-1].item() == 3
    assert offsets.cpu().int()[-3:].tolist() == [0, 3, 23]


# --------------------------------------------------------------------------- the header

PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include "torchstash/sparse.h"
using namespace torchstash;

// A serial top-k with sparse.h's keys, start_selection, high_mask, select_digit and
// take_lowest (what the CUDA kernels call), the mask written a byte at a time.
template <class K>
void topk(const std::vector<typename K::Word>& x, long segments, long k, std::vector<std::uint8_t>& out) {
  const long n = static_cast<long>(x.size());
  const long length = n / segments;
  out.assign((n + 7) / 8, 0);
  for (long s = 0; s < segments; ++s) {
    const long a = s * length;
    sparse::Selection sel = sparse::start_selection(k, length);
    for (int p = K::kPasses - 1; p >= 0 && !sel.done; --p) {
      unsigned long long hist[sparse::kBins] = {};
      const std::uint32_t himask = sparse::high_mask(8 * p);
      for (long i = a; i < a + length; ++i) {
        const std::uint32_t key = K::key(x[i]);
        if ((key & himask) == sel.prefix) ++hist[(key >> (8 * p)) & 0xFF];
      }
      sparse::select_digit(&sel, hist, 8 * p);
    }
    const std::int32_t t = sparse::threshold32(sel);
    long left = sel.ties;
    for (long b = a / 8; b < (a + length + 7) / 8; ++b) {
      std::uint32_t gt = 0, eq = 0;
      for (long i = b * 8 > a ? b * 8 : a; i < b * 8 + 8 && i < a + length; ++i) {
        const auto key = static_cast<std::int32_t>(K::key(x[i]));
        gt |= static_cast<std::uint32_t>(key > t) << (i & 7);
        eq |= static_cast<std::uint32_t>(key == t) << (i & 7);
      }
      const std::uint32_t taken = sparse::take_lowest(eq, left);
      left -= sparse::popcount32(taken);
      out[b] = static_cast<std::uint8_t>(out[b] | gt | taken);
    }
  }
}

// argv: kind (0 f32, 1 f32 coarse, 2 f16, 3 bf16), segments, k, input file, output file.
int main(int argc, char** argv) {
  if (argc != 6) return 2;
  const int kind = std::atoi(argv[1]);
  const long segments = std::atol(argv[2]);
  const long k = std::atol(argv[3]);
  std::FILE* in = std::fopen(argv[4], "rb");
  std::vector<std::uint8_t> bytes;
  int c;
  while ((c = std::fgetc(in)) != EOF) bytes.push_back(static_cast<std::uint8_t>(c));
  std::fclose(in);
  std::vector<std::uint8_t> out;
  if (kind <= 1) {
    std::vector<std::uint32_t> x(bytes.size() / 4);
    std::memcpy(x.data(), bytes.data(), bytes.size());
    if (kind == 0) topk<sparse::KeyF32>(x, segments, k, out); else topk<sparse::KeyF32Coarse>(x, segments, k, out);
  } else {
    std::vector<std::uint16_t> x(bytes.size() / 2);
    std::memcpy(x.data(), bytes.data(), bytes.size());
    if (kind == 2) topk<sparse::KeyF16>(x, segments, k, out); else topk<sparse::KeyBF16>(x, segments, k, out);
  }
  std::FILE* o = std::fopen(argv[5], "wb");
  std::fwrite(out.data(), 1, out.size(), o);
  std::fclose(o);
  // mask_byte clears the bits past n; take_lowest keeps the lowest set bits.
  const std::uint8_t m[2] = {0xFF, 0xFF};
  if (sparse::mask_byte(m, 1, 11) != 0x07 || sparse::mask_byte(m, 0, 11) != 0xFF) return 3;
  if (sparse::take_lowest(0xB4u, 2) != 0x14u || sparse::take_lowest(0xB4u, 9) != 0xB4u) return 4;
  if (sparse::take_lowest(0xB4u, 0) != 0u || sparse::take_lowest(0xB4u, -3) != 0u) return 5;
  return 0;
}
"""


def test_header_functions_match_the_reference(tmp_path: Any) -> None:
    """sparse.h's keys and radix-select step (what the CUDA kernels run), in a serial top-k
    compiled for the host, against the reference."""
    program = build_host_program(PROGRAM, tmp_path, loader_flags=False)
    cases = [(kind, dtype, exact) for kind in KINDS for dtype in DTYPES for exact in (True, False)]
    for data_kind, dtype, exact in cases:
        segments, length = 7, 301
        x = _data(segments * length, data_kind, seed=len(data_kind)).to(dtype)
        code = {torch.float16: 2, torch.bfloat16: 3}.get(dtype, 0 if exact else 1)
        (tmp_path / "in.bin").write_bytes(x.view(INT_VIEW[dtype]).numpy().tobytes())
        for k in (0, 1, 50, 150, 300, 301):
            run_host_program(
                program, str(code), str(segments), str(k), str(tmp_path / "in.bin"),
                str(tmp_path / "out.bin"),
            )  # fmt: skip
            got = torch.frombuffer(
                bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.uint8
            )
            assert torch.equal(got, topk_mask_ref(x, segments, k, exact)), (
                data_kind,
                dtype,
                exact,
                k,
            )
