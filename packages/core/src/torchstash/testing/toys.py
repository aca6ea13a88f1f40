"""Small compressors for tests: they exercise the engine without any plug-in installed."""

from __future__ import annotations

import torch

from ..compressor import BaseCompressor
from ..packed import Packed
from ..site import Site


class CloneCompressor(BaseCompressor):
    """Lossless: stores a contiguous copy. Proves the engine restores exactly what it was given."""

    name = "test.clone"
    lossless = True

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        p = Packed.like(x, self.name, data=x.detach().clone(memory_format=torch.contiguous_format))
        p.meta["stride"] = tuple(x.stride())
        return p

    def decompress(self, packed: Packed) -> torch.Tensor:
        data = packed.tensors["data"]
        assert isinstance(data, torch.Tensor)
        return data


class HalfCompressor(BaseCompressor):
    """Lossy: stores bfloat16 (fp32 inputs shrink 2x). NaN and Inf survive the cast."""

    name = "test.half"
    lossless = False

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        return Packed.like(x, self.name, data=x.detach().to(torch.bfloat16))

    def decompress(self, packed: Packed) -> torch.Tensor:
        data = packed.tensors["data"]
        assert isinstance(data, torch.Tensor)
        return data.to(packed.dtype)
