"""The shared sign-bit codec: a ReLU's backward from it is stock's, bit for bit."""

from __future__ import annotations

import pytest
import torch

from torchstash.kernels import loader
from torchstash.signs import SignBits, pack_sign, sign_bits, sign_gradient, unpack_sign
from torchstash.site import Site
from torchstash.testing.bits import assert_bits_equal


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


def _relu_input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape).to(dtype)
    x.view(-1)[:5] = torch.tensor([float("nan"), 0.0, -0.0, float("inf"), -1e-30]).to(dtype)
    return x


#: gradients laid out as the output (the one-pass kernel) and otherwise (the fallback)
GRAD_LAYOUTS = ["same", "channels_last", "transposed", "strided"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("out_layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("grad_layout", GRAD_LAYOUTS)
def test_sign_gradient_is_stocks_relu_backward(
    dtype: torch.dtype, out_layout: str, grad_layout: str
) -> None:
    """Bit for bit ``threshold_backward(grad, out, 0)``, with its strides, for every pairing of
    the output's and the gradient's layouts (NaN, Inf and -0.0 in both)."""
    x = _relu_input((2, 3, 9, 7), dtype)
    if out_layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    out = torch.relu(x)
    g = _relu_input((2, 3, 9, 7), dtype).flip(0)
    if grad_layout == "same":
        g = g.clone(memory_format=torch.preserve_format).as_strided(out.shape, out.stride())
        g.copy_(_relu_input((2, 3, 9, 7), dtype))
    elif grad_layout == "channels_last":
        g = g.contiguous(memory_format=torch.channels_last)
    elif grad_layout == "transposed":
        g = g.transpose(2, 3).contiguous().transpose(2, 3)
    else:
        g = torch.cat([g, g], dim=3)[..., ::2]
    bits, order = sign_bits(out)
    got = sign_gradient(g, bits, out.shape, order)
    want = torch.ops.aten.threshold_backward(g, out, 0)
    assert_bits_equal(got, want)
    if g.is_contiguous() or g.is_contiguous(memory_format=torch.channels_last):
        assert got.stride() == want.stride()


def test_sign_gradient_takes_one_kernel_pass_where_the_layouts_agree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not loader.available("cpu"):
        pytest.skip("compiled kernels unavailable")
    import torchstash.signs as signs

    calls: list[str] = []
    for name in ("sign_select", "sign_unpack"):
        original = getattr(signs, name)
        monkeypatch.setattr(
            signs, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k)
        )
    out = torch.relu(torch.randn(2, 4, 5, 5)).contiguous(memory_format=torch.channels_last)
    bits, order = sign_bits(out)
    sign_gradient(
        torch.randn(2, 4, 5, 5).contiguous(memory_format=torch.channels_last),
        bits,
        out.shape,
        order,
    )
    assert calls == ["sign_select"]
    calls.clear()
    sign_gradient(torch.randn(2, 4, 5, 5), bits, out.shape, order)  # another layout
    assert calls == ["sign_unpack"]
