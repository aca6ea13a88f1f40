"""``dropit.random``: keep a uniformly random (1 - p) share of a linear-type input, rescaled.

Each segment keeps exactly ``k`` of its ``L`` entries, a uniformly random subset, each scaled
by ``L / k``: every entry is kept with probability ``k / L``, so the stored tensor, and the
weight gradient computed from it, are unbiased. The subset is the top ``k`` of Philox
uniforms drawn from a private stream (so the user's random state is untouched), selected by
the same radix select and stored in the same bitmap or offset forms as ``dropit.mink``.
"""

from __future__ import annotations

import torch

from torchstash.kernels import philox_uniform
from torchstash.kernels.sparse import mask_compact, topk_mask
from torchstash.seeds import SeedStream

from .mink import MIN_NUMEL, MinK


class RandomDrop(MinK):
    """Unbiased random sparsification: a random ``1 - p`` share kept, scaled up to match."""

    def __init__(
        self,
        p: float = 0.9,
        scope: str = "tensor",
        storage_form: str = "auto",
        seed: int | None = None,
        min_numel: int = MIN_NUMEL,
        name: str = "dropit.random",
        keep: str = "ceil",
        dense: str = "exact",
        indices: str = "device",
    ) -> None:
        from ._options import check_gamma

        super().__init__(
            check_gamma(p, name, "p"),
            scope,
            storage_form,
            True,
            min_numel,
            name,
            keep=keep,
            dense=dense,
            indices=indices,
        )
        self.seeds = SeedStream(seed)

    def select(self, flat: torch.Tensor, segments: int, k: int) -> torch.Tensor:
        """A uniformly random ``k`` of each segment: the top ``k`` of fresh uniforms; NaN and
        Inf rank first (2.0, above every uniform), so an overflow is never dropped."""
        u = philox_uniform(flat.numel(), self.seeds.next(), 0, device=flat.device)
        u = torch.where(flat.reshape(-1).isfinite(), u, 2.0)
        return topk_mask(u, segments, k)

    def kept_values(
        self, flat: torch.Tensor, mask: torch.Tensor, kept: int, segments: int
    ) -> torch.Tensor:
        """The kept entries scaled by ``L / k``, so their expectation is the dense tensor."""
        k = kept // segments
        values = mask_compact(flat, mask, kept)
        return values.mul_((flat.numel() // segments) / k) if k else values
