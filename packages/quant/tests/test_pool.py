"""Max-pool indices stored as positions in their windows (``torchstash_quant.pool``): exact,
and small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchstash as ts
from torchstash.windows import window_bits
from torchstash_quant.pool import pack_pool_positions, pool_geometry, unpack_pool_positions

CASES = [
    dict(kernel_size=3, stride=2, padding=1),  # ResNet's stem
    dict(kernel_size=2),
    dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0)),
    dict(kernel_size=3, stride=1, padding=1, dilation=2),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=5, stride=3, padding=2),  # 25 positions: 8 bits
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape", [(2, 3, 17, 14), (3, 12, 11)], ids=["batched", "unbatched"])
def test_positions_restore_the_indices_exactly(
    options: dict[str, object], shape: tuple[int, ...]
) -> None:
    x = torch.randn(shape)
    x[..., ::4, ::3] = 0.0  # ties: the kernel's choice among them is what must come back
    _, indices = F.max_pool2d(x, return_indices=True, **options)  # type: ignore[arg-type]
    geometry = pool_geometry((x,), dict(options))
    assert geometry is not None
    packed = pack_pool_positions(indices, geometry)
    assert packed is not None
    assert torch.equal(unpack_pool_positions(packed), indices)
    bits = window_bits(geometry[2] * geometry[3])
    assert bits == {4: 2, 6: 4, 9: 4, 25: 8}[geometry[2] * geometry[3]]
    assert packed.nbytes() <= -(-indices.numel() * bits // 8) + 8


def test_indices_outside_their_window_are_left_as_they_are() -> None:
    x = torch.randn(1, 1, 8, 8)
    _, indices = F.max_pool2d(x, 2, return_indices=True)
    geometry = pool_geometry((x, 2), {})
    assert geometry is not None
    assert pack_pool_positions(indices.flip(-1), geometry) is None  # another window's argmax


def test_unreadable_arguments_have_no_geometry() -> None:
    x = torch.randn(1, 1, 8, 8)
    assert pool_geometry((x,), {"kernel_size": 2.5}) is None
    assert pool_geometry((x.flatten(),), {"kernel_size": 2}) is None
    assert pool_geometry((x, (2, 2, 2)), {}) is None


@pytest.mark.parametrize("strategy", ["quant.int8", "quant.int2", "quant.mesa", "quant.auto"])
def test_pool_gradients_are_stock_and_indices_cost_4_bits(strategy: str) -> None:
    """The pool's backward reads only its indices: with them exact, every gradient is stock's
    to the bit, and they cost 4 bits each instead of 64."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(3, 2, 1))
    x = torch.randn(4, 3, 16, 16, requires_grad=True)

    def grads() -> list[torch.Tensor]:
        x.grad = None
        model.zero_grad()
        model(x).square().sum().backward()
        return [t.grad.clone() for t in (x, *model.parameters()) if t.grad is not None]

    ref = grads()
    policy = [{"strategy": strategy}, {"op": "max_pool", "role": "input", "strategy": "none"}]
    with ts.apply(model, policy=policy, min_bytes=0) as h:
        got = grads()
        row = h.tally.rows["1"]
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    pool_input, indices = 4 * 8 * 16 * 16 * 4, 4 * 8 * 8 * 8
    assert row.raw_bytes == pool_input + indices * 8
    assert row.stored_bytes == pool_input + indices // 2
