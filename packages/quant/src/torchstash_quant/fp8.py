"""``quant.fp8``: e4m3 codes with a per-group scale, for those who prefer a float code.

Each group of ``group_size`` elements is scaled so its largest finite magnitude maps to 448
(the e4m3 maximum), then rounded to the nearest e4m3 value (one byte per element). A group
holding NaN or Inf scales its finite values to at most 240 instead, which frees the codes
with an all-ones exponent: +Inf is 0x78, -Inf 0xF8, NaN 0x7F; its scale is stored negative.
So NaN and Inf come back where they were, with no host synchronisation.
"""

from __future__ import annotations

import torch

from torchstash.compressor import BaseCompressor
from torchstash.kernels import fp8_dequantize, fp8_quantize
from torchstash.layout import memory_order, restore
from torchstash.packed import Packed
from torchstash.site import Site

from ._dtypes import dtype_reasons
from ._options import check_group_size


class Fp8Quantizer(BaseCompressor):
    name = "quant.fp8"
    lossless = False
    replays = True
    traceable = True

    def __init__(self, group_size: int = 256) -> None:
        self.group_size = check_group_size(group_size, self.name)

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return dtype_reasons(self, self.name, x.dtype)

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        """One kernel pass (:func:`torchstash.kernels.fp8_quantize`). The codes are those of
        whole groups, the padding's included, as they always were stored."""
        flat, inverse = memory_order(x)
        codes, scale = fp8_quantize(flat, self.group_size)
        packed = Packed.like(x, self.name, codes=codes[: x.numel()], scale=scale)
        packed.meta.update(group_size=self.group_size, order=inverse)
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        codes, scale = packed.tensors["codes"], packed.tensors["scale"]
        assert isinstance(codes, torch.Tensor) and isinstance(scale, torch.Tensor)
        flat = fp8_dequantize(codes, scale, self.group_size, packed.numel, packed.dtype)
        order = packed.meta.get("order")
        return restore(flat, packed.shape, order if isinstance(order, tuple) else None)
