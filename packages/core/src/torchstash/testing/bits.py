"""Bit-for-bit comparison of float tensors, for kernels that must match their reference."""

from __future__ import annotations

import torch

#: The integer dtype of the same width, to compare floats by their bits.
INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same dtype, shape and bits, NaN payloads aside (NaNs must sit at the same places)."""
    got = got.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if not want.dtype.is_floating_point:
        assert torch.equal(got, want)
        return
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN positions differ"
    view = INT_VIEW[want.dtype]
    assert torch.equal(got[~nan].view(view), want[~nan].view(view))
