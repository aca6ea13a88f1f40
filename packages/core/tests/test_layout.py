"""Memory order and the strides a restore gives back (``torchstash.layout``)."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchstash.layout import dense_strides, memory_order, restore


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


BASE = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)
CASES = {
    "contiguous": (BASE, True),
    "transposed": (BASE.transpose(1, 3), True),
    "channels_last": (BASE.contiguous(memory_format=torch.channels_last), True),
    "slice": (BASE[:, 1:], False),
    "chunk of the last dim": (BASE.chunk(5, -1)[1], False),
    "1-d stride 2": (torch.arange(10.0)[::2], False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_strides_asks_without_a_copy(name: str) -> None:
    """A layout question is answered from strides: a strided slice (attention's q, k, v
    chunks) is not copied to find it is not dense."""
    x, dense = CASES[name]
    with _Ops() as ops:
        got = dense_strides(x)
    assert got == (tuple(x.stride()) if dense else None)
    copies = {op: n for op, n in ops.seen.items() if op in ("clone", "contiguous", "copy_")}
    assert not copies, copies


@pytest.mark.parametrize("name", sorted(CASES))
def test_memory_order_round_trips(name: str) -> None:
    x, dense = CASES[name]
    flat, inverse = memory_order(x)
    assert flat.is_contiguous() and (inverse is not None) == (dense and not x.is_contiguous())
    back = restore(flat.reshape(-1), x.shape, inverse)
    assert torch.equal(back, x)
    if dense:
        assert back.stride() == x.stride()
