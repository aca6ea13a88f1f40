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


def _keeps_statistics(x: torch.Tensor, site: Site) -> list[str]:
    """A LayerNorm's or BatchNorm's saved statistics stay exact: a recipe needs them as they
    are."""
    if site.op in ("layer_norm", "batch_norm") and site.role == "output":
        return [f"a {site.op}'s statistics are kept exact"]
    return []


class DerivableClone(CloneCompressor):
    """:class:`CloneCompressor` whose copies may stand in for an op's output: the engine
    recomputes a LayerNorm's, BatchNorm's, GELU's, SiLU's or attention's output from the stored input (exact inputs,
    so a GELU's recomputed output is bit-exact)."""

    name = "test.derive"

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return super().unsupported(x, site) + _keeps_statistics(x, site)

    def derivable(self, x: torch.Tensor, site: Site) -> bool:
        return True


class DerivableHalf(HalfCompressor):
    """:class:`HalfCompressor` whose codes may stand in for an op's output (lossy)."""

    name = "test.derive_half"

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return super().unsupported(x, site) + _keeps_statistics(x, site)

    def derivable(self, x: torch.Tensor, site: Site) -> bool:
        return True
