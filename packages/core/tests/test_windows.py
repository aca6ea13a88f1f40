"""Max-pool indices as positions in their windows (``torchstash.windows``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from torchstash import windows
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
