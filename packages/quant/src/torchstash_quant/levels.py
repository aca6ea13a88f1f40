"""ActNN's optimization levels as presets: ``quant.L0`` ... ``quant.L5``.

| level | ActNN | here |
|---|---|---|
| L0 | no compression | saved tensors stored as they are |
| L1 | 4-bit conv/linear inputs | 4-bit inputs of ``linear`` and ``conv`` ops, the rest as is |
| L2 | 4-bit everywhere | ``quant.int4`` |
| L3 | 2 bits on average, mixed | ``quant.auto`` with ``budget=2`` |
| L4 | L3 + swap to host | L3, its payloads moved to pinned host memory (``offload.cpu``) |
| L5 | L4 + defragmentation | L4 with the CUDA allocator's expandable segments turned on |

L5 needs no patched PyTorch (ActNN's did): ``expandable_segments`` is a setting of today's
caching allocator. It is process-wide and stays on; on a machine without CUDA it is skipped.
"""

from __future__ import annotations

import torch

from torchstash.compressor import BaseCompressor, Compressor, replays_at, replays_next
from torchstash.packed import Packed
from torchstash.site import Site

LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5")


class OnlyOps(BaseCompressor):
    """``inner`` on the tensors saved by ``ops``; everything else stays as it is."""

    lossless = False

    def __init__(self, inner: Compressor, ops: frozenset[str]) -> None:
        self.inner = inner
        self.ops = ops
        self.name = inner.name

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        if site.op not in self.ops:
            return [f"{self.name} compresses only what {', '.join(sorted(self.ops))} save"]
        return self.inner.unsupported(x, site)

    def replays_at(self, x: torch.Tensor, site: Site) -> bool:
        return replays_at(self.inner, x, site)

    def replays_next(self) -> bool:
        return replays_next(self.inner)

    def compress(self, x: torch.Tensor, site: Site) -> Packed | torch.Tensor:
        return self.inner.compress(x, site)

    def decompress(self, packed: Packed) -> torch.Tensor:
        return self.inner.decompress(packed)


SUMMARIES = {
    "L0": "ActNN level L0: no compression",
    "L1": "ActNN level L1: 4-bit linear and conv inputs",
    "L2": "ActNN level L2: 4-bit everywhere",
    "L3": "ActNN level L3: 2 bits on average, mixed precision (quant.auto)",
    "L4": "ActNN level L4: L3 with payloads in pinned host memory",
    "L5": "ActNN level L5: L4 with the CUDA allocator's expandable segments",
}
