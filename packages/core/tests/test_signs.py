"""The shared sign-bit codec: a ReLU's backward from it is stock's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from torchstash.signs import SignBits, pack_sign, unpack_sign
from torchstash.site import Site


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_relu_backward_from_the_bits_is_stocks(dtype: torch.dtype, channels_last: bool) -> None:
    x = torch.randn(2, 3, 9, 7).to(dtype)
    x[0, 0, 0, :3] = torch.tensor([float("nan"), 0.0, -0.0])
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    out = torch.relu(x)
    g = torch.randn_like(x)
    packed = pack_sign(out)
    restored = unpack_sign(packed)
    assert restored.dtype == dtype and restored.shape == x.shape
    assert restored.stride() == out.stride()  # the code keeps the tensor's layout
    expected = torch.ops.aten.threshold_backward(g, out, 0)
    got = torch.ops.aten.threshold_backward(g, restored, 0)
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())
    assert packed.nbytes() <= (x.numel() + 7) // 8 + 64  # one bit per element


def test_the_compressor_names_itself_and_declines_integers() -> None:
    codec = SignBits("memsave.relu_mask")
    assert codec.compress(torch.randn(16), Site()).codec == "memsave.relu_mask"
    assert codec.unsupported(torch.ones(4, dtype=torch.int64), Site())
    assert not codec.unsupported(torch.ones(4), Site())
