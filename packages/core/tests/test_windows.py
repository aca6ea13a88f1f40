"""Max-pool indices as positions in their windows (``torchstash.windows``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchstash import kernels as K
from torchstash import windows
from torchstash.testing.hostreads import host_reads
from torchstash.windows import decode_positions, encode_positions, window_bits, window_starts

POOLS = {2: F.max_pool2d, 3: F.max_pool3d}


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    ("nd", "kernel", "stride", "padding", "dilation"),
    [
        (2, (3, 3), (2, 2), (1, 1), (1, 1)),
        (2, (2, 3), (1, 2), (1, 0), (2, 1)),
        (3, (2, 2, 2), (2, 2, 2), (0, 0, 0), (1, 1, 1)),
        (2, (17, 17), (1, 1), (8, 8), (1, 1)),  # 289 positions: int16
    ],
)
def test_positions_round_trip(
    nd: int,
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    index_dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exact both ways, in int32 arithmetic (planes under 2**31 elements) and in int64 (the
    larger ones), and the caller's indices left as they were."""
    monkeypatch.setattr(windows, "_index_dtype", lambda in_sizes: index_dtype)
    x = torch.randn(2, 3, *([19] * nd))
    _, indices = POOLS[nd](x, kernel, stride, padding, dilation, return_indices=True)
    before = indices.clone()
    starts = window_starts(indices.shape[-nd:], stride, padding, x.device)
    code = encode_positions(indices, x.shape[-nd:], starts, kernel, dilation)
    window = 1
    for k in kernel:
        window *= k
    assert int(code.max()) < window
    assert code.dtype == (torch.uint8 if window <= 256 else torch.int16)
    assert torch.equal(decode_positions(code, x.shape[-nd:], starts, kernel, dilation), indices)
    assert torch.equal(indices, before)


def test_an_index_outside_its_window_does_not_come_back() -> None:
    x = torch.randn(1, 1, 8, 8)
    _, indices = F.max_pool2d(x, 2, return_indices=True)
    wrong = indices.flip(-1)  # each index now belongs to another window
    starts = window_starts(wrong.shape[-2:], (2, 2), (0, 0), x.device)
    code = encode_positions(wrong, (8, 8), starts, (2, 2), (1, 1))  # no error
    assert not torch.equal(decode_positions(code, (8, 8), starts, (2, 2), (1, 1)), wrong)


def test_window_bits() -> None:
    assert [window_bits(k) for k in (1, 2, 3, 4, 9, 16, 17, 256, 257)] == [
        1,
        1,
        2,
        2,
        4,
        4,
        8,
        8,
        None,
    ]


def test_tables_are_built_once_per_geometry_and_device() -> None:
    """A host-built table copied to the device on every call would make the host wait for the
    device once per pool (on CUDA); a fake tensor's tables are never cached."""
    x = torch.zeros(2, 3, dtype=torch.long)
    first = windows._tables(x, [8, 8], [3, 3], [1, 1])
    assert windows._tables(x, (8, 8), (3, 3), (1, 1))[0] is first[0]
    assert windows._tables(x, [8, 8], [2, 2], [1, 1])[0] is not first[0]
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        assert windows._tables(fake, [8, 8], [3, 3], [1, 1])[0] is not first[0]


# -- pool_code: the pool and its positions in one pass ------------------------------------------

GEOMETRIES = [  # (kernel, stride, padding, dilation, ceil_mode): every width of the codes
    ((1, 2), (1, 2), (0, 1), (1, 1), False),  # 2 positions: 1 bit
    ((2, 2), (2, 2), (0, 0), (1, 1), False),  # 4: 2 bits
    ((3, 3), (2, 2), (1, 1), (1, 1), False),  # 9: 4 bits, a ResNet stem's
    ((3, 3), (2, 2), (1, 1), (1, 1), True),
    ((3, 2), (1, 3), (1, 1), (2, 1), True),  # overlapping rows, dilated
    ((5, 5), (1, 1), (2, 2), (1, 1), False),  # 25: 8 bits, every element in several windows
    ((4, 3), (3, 2), (2, 0), (2, 2), True),
]


def _pool_input(shape: tuple[int, ...], kind: str) -> torch.Tensor:
    """Values with ties, NaN or -inf where ``kind`` asks: the argmax rules are tested there."""
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    if kind == "ties":
        return torch.randint(-2, 3, shape, generator=gen).float()
    x = torch.randn(shape, generator=gen)
    flat = x.view(-1)
    picks = torch.randint(0, x.numel(), (max(1, x.numel() // 20),), generator=gen)
    if kind == "nan":
        flat[picks] = float("nan")
    elif kind == "-inf":
        flat[picks] = float("-inf")
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "nan", "-inf"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 11, 13), (3, 17, 9)], ids=["4d", "3d"])
def test_pool_code_is_aten_s_pool_and_backward_bit_for_bit(
    geometry: tuple[tuple[int, ...], ...], kind: str, shape: tuple[int, ...]
) -> None:
    """The output and the gradient are stock's bit for bit (NaN where it lies, ties to the
    first, -inf never taken), the positions are those :func:`encode_positions` gives ATen's
    indices, and the compiled kernel is its reference's golden copy."""
    kernel, stride, padding, dilation, ceil_mode = geometry
    x = _pool_input(shape, kind)
    assert windows.pool_code_refusal(x, *geometry) == []
    xs = x.clone().requires_grad_()
    stock, indices = F.max_pool2d(
        xs, kernel, stride, padding, dilation, ceil_mode, return_indices=True
    )
    out, packed, bits = windows.pool_code(x, *geometry)
    assert torch.equal(out.view(torch.int32), stock.detach().view(torch.int32))
    starts = window_starts(indices.shape[-2:], stride, padding, x.device)
    code = encode_positions(indices, x.shape[-2:], starts, kernel, dilation)
    assert bits == window_bits(kernel[0] * kernel[1])
    assert torch.equal(packed, K.pack_bits(code.reshape(-1), bits))
    grad = torch.randn_like(stock)
    stock.backward(grad)
    gx = windows.pool_code_backward(grad, packed, x.shape, *geometry, bits)
    assert torch.equal(gx, xs.grad)
    if K.available("cpu"):
        table = windows._tables(x, x.shape[-2:], kernel, dilation)[0]
        for impl in ("ref", "kernel"):
            o, p = K.max_pool2d_code(x, *geometry, table, bits, impl=impl)
            assert torch.equal(o.view(torch.int32), out.view(torch.int32)) and torch.equal(
                p, packed
            )
            g = K.max_pool2d_code_backward(grad, packed, x.shape, *geometry, bits, impl=impl)
            assert torch.equal(g, gx)


def test_pool_code_says_why_it_cannot_pool() -> None:
    """Each input it leaves to ATen's pool, with the reason."""
    x = torch.randn(2, 3, 8, 8)
    geometry = ((3, 3), (2, 2), (1, 1), (1, 1), False)
    assert windows.pool_code_refusal(x, *geometry) == []

    def why(t: torch.Tensor, *g: object) -> str:
        return " ".join(windows.pool_code_refusal(t, *(g or geometry)))

    assert "float32" in why(x.double())
    assert "contiguous" in why(x.to(memory_format=torch.channels_last))
    assert "2-d" in why(
        torch.randn(2, 3, 4, 8, 8), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1), False
    )
    assert "256" in why(torch.randn(1, 1, 40, 40), (17, 17), (1, 1), (8, 8), (1, 1), False)
    assert "half its kernel" in why(x, (2, 2), (2, 2), (2, 2), (1, 1), False)
    # a 1-row plane: the dilated window's rows at -1, 1 and 3 lie wholly outside it (ATen's
    # pool gives such an output the index of no element, and its backward writes there)
    assert "padding" in why(torch.randn(1, 1, 1, 11), (3, 3), (3, 2), (1, 1), (2, 2), True)


@pytest.mark.skipif(not K.available("cpu"), reason="compiled kernels unavailable")
def test_a_code_that_is_no_position_is_refused_by_name() -> None:
    """The kernel never writes outside the gradient: a code past the window's positions (a
    4-bit code of a 3x3 window is 9 to 15), or a size that is not the pool's, is an error."""
    x = torch.randn(1, 2, 6, 6)
    geometry = ((3, 3), (3, 3), (0, 0), (1, 1), False)
    out, packed, bits = windows.pool_code(x, *geometry)
    grad = torch.ones_like(out)
    assert windows.pool_code_backward(grad, packed, x.shape, *geometry, bits).sum() == out.numel()
    with pytest.raises(ValueError, match="max_pool2d_code_backward: a code is not a position"):
        K.max_pool2d_code_backward(grad, torch.full_like(packed, 0xFF), x.shape, *geometry, bits)
    with pytest.raises(ValueError, match="max_pool2d_code_backward: grad has shape"):
        K.max_pool2d_code_backward(grad, packed, (1, 2, 9, 9), *geometry, bits)


# -- code_indices: a stock pool's indices coded and checked in one pass ---------------------------


@pytest.mark.parametrize("flip", [False, True], ids=["its-own", "misread"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=str)
def test_code_indices_is_encode_positions_with_its_check(
    geometry: tuple[tuple[int, ...], ...], flip: bool
) -> None:
    """The same bytes as :func:`encode_positions` and ``pack_bits``, None exactly where
    :func:`decode_positions` would not give the indices back (indices of another window),
    and the indices back from the code; the kernel bit for bit its reference."""
    kernel, stride, padding, dilation, ceil_mode = geometry
    x = _pool_input((2, 3, 11, 13), "ties")
    _, indices = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    if flip:
        indices = indices.flip(-1)
    plane = tuple(x.shape[-2:])
    starts = window_starts(indices.shape[-2:], stride, padding, x.device)
    code = encode_positions(indices, plane, starts, kernel, dilation)
    exact = torch.equal(decode_positions(code, plane, starts, kernel, dilation), indices)
    coded = windows.code_indices(indices, plane, kernel, stride, padding, dilation)
    assert (coded is not None) == exact
    bits = window_bits(kernel[0] * kernel[1])
    assert bits is not None
    packed = K.pack_bits(code.reshape(-1), bits)
    if coded is not None:
        assert coded[1] == bits and torch.equal(coded[0], packed)
        back = windows.indices_from_code(coded[0], indices.shape, plane, *geometry[:4], bits)
        assert torch.equal(back, indices)
    if K.available("cpu"):
        table = windows._tables(indices, plane, kernel, dilation)[0]
        args = (plane, kernel, stride, padding, dilation, bits)
        for impl in ("ref", "kernel"):
            p, e = K.window_code(indices, table, *args, impl=impl)
            assert torch.equal(p, packed) and bool(e) == exact
            back = K.window_indices(packed, indices.shape, *args, impl=impl)
            assert torch.equal(back, decode_positions(code, plane, starts, kernel, dilation))


@pytest.mark.parametrize("geometry", GEOMETRIES[:2], ids=str)
def test_the_references_read_nothing_on_the_host(geometry: tuple[tuple[int, ...], ...]) -> None:
    """On CUDA the references are the ops (no kernel of their own there): a host read in them
    would make every pool's pack and unpack wait for the device. Its check stays a device
    tensor; reading it is the caller's choice."""
    kernel, stride, padding, dilation, ceil_mode = geometry
    x = _pool_input((2, 3, 11, 13), "ties")
    _, indices = F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
    plane = tuple(x.shape[-2:])
    bits = window_bits(kernel[0] * kernel[1])
    assert bits is not None
    table = windows._tables(indices, plane, kernel, dilation)[0]
    args = (plane, kernel, stride, padding, dilation, bits)
    with host_reads() as stacks:
        packed, exact = K.window_code(indices, table, *args, impl="ref")
        back = K.window_indices(packed, indices.shape, *args, impl="ref")
    assert not stacks, stacks
    assert exact.dim() == 0 and bool(exact) and torch.equal(back, indices)
