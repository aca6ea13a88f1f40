"""``quant.fp8``: e4m3 codes with a per-group scale, for those who prefer a float code.

Each group of ``group_size`` elements is scaled so its largest finite magnitude maps to 448
(the e4m3 maximum), then rounded to the nearest e4m3 value (one byte per element). A group
holding NaN or Inf scales its finite values to at most 240 instead, which frees the codes
with an all-ones exponent: +Inf is 0x78, -Inf 0xF8, NaN 0x7F; its scale is stored negative.
So NaN and Inf come back where they were, with no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchstash.compressor import BaseCompressor
from torchstash.kernels.groupquant_reference import bf16_up
from torchstash.layout import memory_order, restore
from torchstash.packed import Packed
from torchstash.site import Site

from ._dtypes import dtype_reasons
from ._options import check_group_size

E4M3 = torch.float8_e4m3fn
_POS_INF, _NEG_INF, _NAN = 0x78, 0xF8, 0x7F


class Fp8Quantizer(BaseCompressor):
    name = "quant.fp8"
    lossless = False

    def __init__(self, group_size: int = 256) -> None:
        self.group_size = check_group_size(group_size, self.name)

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return dtype_reasons(self, self.name, x.dtype)

    def compress(self, x: torch.Tensor, site: Site) -> Packed:
        flat, inverse = memory_order(x)
        n, gs = x.numel(), self.group_size
        groups = -(-n // gs)
        v = F.pad(flat.reshape(-1).float(), (0, groups * gs - n)).view(groups, gs)
        finite = v.isfinite()
        special = ~finite.all(dim=1, keepdim=True)
        amax = torch.where(finite, v.abs(), 0.0).amax(dim=1, keepdim=True)
        top = torch.where(special, 240.0, 448.0)
        scale = bf16_up(torch.where(amax > 0, amax / top, 1.0))
        codes = (torch.where(finite, v, 0.0) / scale).to(E4M3).view(torch.uint8)
        codes = torch.where(v == float("inf"), _POS_INF, codes)
        codes = torch.where(v == float("-inf"), _NEG_INF, codes)
        codes = torch.where(v.isnan(), _NAN, codes).to(torch.uint8)
        stored_scale = torch.where(special, -scale, scale).to(torch.bfloat16).view(-1)
        packed = Packed.like(x, self.name, codes=codes.view(-1)[:n], scale=stored_scale)
        packed.meta.update(group_size=gs, order=inverse)
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        codes, scale = packed.tensors["codes"], packed.tensors["scale"]
        assert isinstance(codes, torch.Tensor) and isinstance(scale, torch.Tensor)
        n, gs = packed.numel, self.group_size
        gid = torch.arange(n, device=codes.device) // gs
        s = scale.float()[gid]
        special = torch.signbit(s)
        val = codes.view(E4M3).float() * s.abs()
        val = torch.where(special & (codes == _POS_INF), float("inf"), val)
        val = torch.where(special & (codes == _NEG_INF), float("-inf"), val)
        order = packed.meta.get("order")
        flat = val.to(packed.dtype)
        return restore(flat, packed.shape, order if isinstance(order, tuple) else None)
