"""``dropit.mink``: keep the largest-magnitude (1 - gamma) share of linear-type inputs.

DropIT's observation: a linear layer's weight gradient ``G^T X`` barely changes when the
smallest entries of ``X`` are zeroed, and the input gradient never reads ``X``. This keeps
exactly ``k`` entries per segment (the whole tensor, each sample, or each row), found by a
radix select with no sort, and stores them as a bitmap or 16-bit offsets plus the values,
whichever is smaller (:mod:`.storage`). The kept values are a payload another compressor can
take (``dropit.mink>quant.int8``). NaN and Inf rank above every finite value, so an overflow
reaches the weight gradient and GradScaler still sees it.

Dropped entries come back as zeros (``fill="zero"``, DropIT's), or as their feature's mean
(``fill="mean"``): one float per feature (a linear input's last dimension, a conv input's
channel) removes the rank-one bias ``colsum(G) * mean`` that the zeros put in the weight
gradient. It lowers the one-step weight-gradient error on the demo GPT (by half at
initialization, ``python -m torchstash_bench.dropit error``), yet trained that model to a
worse held-out loss (+5.6% against +4.1% for zeros at gamma 0.9), so it is not the default.
"""

from __future__ import annotations

import math

import torch

from torchstash.compressor import BaseCompressor
from torchstash.kernels.bitpack import unpack_mask
from torchstash.kernels.sparse import (
    mask_compact,
    mask_offsets,
    mask_scatter,
    offsets_scatter,
    topk_mask,
)
from torchstash.layout import memory_order, restore
from torchstash.packed import Packed
from torchstash.site import Site

from . import storage
from ._options import (
    DENSES,
    FILLS,
    INDICES,
    KEEPS,
    SCOPES,
    STORAGES,
    check_choice,
    check_gamma,
    check_min_numel,
)
from .sites import batch_of_op, why_not_linear_input

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Tensors with fewer elements are stored as they are: a handful of values saves nothing.
MIN_NUMEL = 4096
#: A feature's dropped entries are averaged only when it has this many entries in all.
MIN_PER_FEATURE = 16


class MinK(BaseCompressor):
    """Keeps the ``1 - gamma`` largest magnitudes per segment of a linear-type input."""

    lossless = False
    composable = ("values",)

    def __init__(
        self,
        gamma: float = 0.9,
        scope: str = "feature",
        storage_form: str = "auto",
        exact: bool = True,
        min_numel: int = MIN_NUMEL,
        name: str = "dropit.mink",
        fill: str = "zero",
        keep: str = "ceil",
        dense: str = "exact",
        indices: str = "device",
    ) -> None:
        self.name = name
        self.gamma = check_gamma(gamma, name)
        self.scope = check_choice(scope, "scope", SCOPES, name)
        self.storage = check_choice(storage_form, "storage", STORAGES, name)
        if not isinstance(exact, bool):
            from torchstash.errors import OptionError

            raise OptionError(f"{name}: option exact={exact!r} must be True or False")
        self.exact = exact
        self.min_numel = check_min_numel(min_numel, name)
        self.fill = check_choice(fill, "fill", FILLS, name)
        #: how the kept count per segment is rounded: up (at least one value stays) or down
        #: (DropIT's ``int(numel * (1 - gamma))``)
        self.keep = check_choice(keep, "keep", KEEPS, name)
        #: where no sparse form is smaller: ``"exact"`` stores the tensor as it is (gradients
        #: exact), ``"drop"`` drops all the same and stores the rest dense (DropIT's gradients,
        #: with no saving: what DropIT did at small gammas)
        self.dense = check_choice(dense, "dense", DENSES, name)
        #: where the positions of the kept entries live: on the tensor's device, or in host
        #: memory (DropIT's ``mink_cpuidx``), brought back for the backward
        self.indices = check_choice(indices, "indices", INDICES, name)

    # -- what it takes -------------------------------------------------------------------------

    def segments(self, flat: torch.Tensor, x: torch.Tensor, site: Site | None = None) -> int:
        """How many equal segments ``x`` (in memory order ``flat``) is ranked in."""
        if self.scope == "tensor" or flat.dim() == 0 or x.dim() < 2:
            return 1
        if self.scope == "feature":
            return int(x.shape[feature_dim(x, site or Site())])
        if self.scope == "row":
            return flat.numel() // max(int(flat.shape[-1]), 1)
        return batch_of_op(x, site or Site()) if x.is_contiguous() else int(flat.shape[0])

    def ordered(self, x: torch.Tensor, site: Site) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """``x`` in the order its segments are contiguous, and the permutation that undoes
        it: memory order, or with ``scope="feature"`` the feature axis outermost (a copy)."""
        if self.scope != "feature" or x.dim() < 2:
            return memory_order(x)
        feature = feature_dim(x, site)
        perm = [feature, *(d for d in range(x.dim()) if d != feature)]
        inverse = [0] * x.dim()
        for i, d in enumerate(perm):
            inverse[d] = i
        return x.permute(perm).contiguous(), tuple(inverse)

    def kept_per_segment(self, length: int) -> int:
        """``ceil((1 - gamma) * length)``: at least one value of a non-empty segment stays
        (``keep="floor"``: DropIT's ``int((1 - gamma) * length)``, which may be none)."""
        if self.keep == "floor":
            return min(length, int((1.0 - self.gamma) * length))
        return min(length, math.ceil((1.0 - self.gamma) * length - 1e-9))

    def plan(self, x: torch.Tensor, site: Site | None = None) -> tuple[int, int, str]:
        """(segments, kept per segment, storage form) for ``x``; the form is dense where no
        sparse form (with its fill values) is smaller."""
        flat, _ = memory_order(x)
        segments = self.segments(flat, x, site)
        k = self.kept_per_segment(x.numel() // segments)
        forms = (storage.BITMAP, storage.OFFSETS) if self.storage == "auto" else (self.storage,)
        extra = 4 * self.fill_features(x, site or Site())
        form = storage.cheapest(x.numel(), segments * k, x.element_size(), forms, extra)
        return segments, k, form

    def fill_features(self, x: torch.Tensor, site: Site) -> int:
        """How many fill values ``x`` gets: one per feature with ``fill="mean"`` when each
        feature has at least :data:`MIN_PER_FEATURE` entries to average, else none (zeros)."""
        if self.fill != "mean" or x.dim() < 2:
            return 0
        features = int(x.shape[feature_dim(x, site)])
        return features if x.numel() >= MIN_PER_FEATURE * features else 0

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        if x.dtype not in FLOAT_DTYPES:
            return [f"{self.name} thins float32, float16 and bfloat16 tensors, got {x.dtype}"]
        why = why_not_linear_input(x, site)
        if why:
            return [why]
        if not site.training:
            return [f"{site.module or 'the module'} is in eval mode: gradients stay exact"]
        if self.gamma == 0.0:
            return ["gamma=0 drops nothing: stored as is, gradients exact"]
        if x.numel() < self.min_numel:
            return [
                f"{x.numel()} elements is below min_numel={self.min_numel}: "
                "too small to save anything"
            ]
        if self.plan(x, site)[2] == storage.DENSE and self.dense == "exact":
            return [
                f"at gamma={self.gamma} no sparse form of a {x.dtype} tensor is smaller than dense"
            ]
        return []

    # -- codec ---------------------------------------------------------------------------------

    def select(self, flat: torch.Tensor, segments: int, k: int) -> torch.Tensor:
        """The packed mask of the entries kept: the ``k`` largest magnitudes per segment."""
        return topk_mask(flat, segments, k, exact=self.exact)

    def kept_values(
        self, flat: torch.Tensor, mask: torch.Tensor, kept: int, segments: int
    ) -> torch.Tensor:
        return mask_compact(flat, mask, kept)

    def compress(self, x: torch.Tensor, site: Site) -> Packed | torch.Tensor:
        segments, k, form = self.plan(x, site)
        if form == storage.DENSE and self.dense == "exact":
            return x
        flat, inverse = self.ordered(x, site)
        mask = self.select(flat, segments, k)
        kept = segments * k
        if form == storage.DENSE:  # dense="drop": the dropped entries zeroed, stored dense
            dropped = mask_scatter(mask, self.kept_values(flat, mask, kept, segments), x.numel())
            out = restore(dropped, x.shape, inverse)
            if self.fill_features(x, site):
                feature = feature_dim(x, site)
                present = restore(unpack_mask(mask, x.numel()), x.shape, inverse)
                shape = [1] * x.dim()
                shape[feature] = int(x.shape[feature])
                fill = dropped_means(x, present, feature).to(x.dtype).view(shape)
                out = torch.where(present, out, fill)
            packed = Packed.like(x, self.name, values=out)
            packed.meta.update(form=form)
            return packed
        values = self.kept_values(flat, mask, kept, segments)
        packed = Packed.like(x, self.name, values=values)
        if form == storage.BITMAP:
            packed.tensors["mask"] = mask
        else:
            offsets, counts = mask_offsets(mask, x.numel(), kept)
            packed.tensors.update(offsets=offsets, counts=counts)
        packed.meta.update(form=form, order=inverse, segments=segments, k=k)
        if self.indices == "cpu":
            for key in ("mask", "offsets", "counts"):
                index = packed.tensors.get(key)
                if isinstance(index, torch.Tensor):
                    packed.tensors[key] = index.cpu()  # blocking: pageable host memory
        if self.fill_features(x, site):
            feature = feature_dim(x, site)
            present = restore(unpack_mask(mask, x.numel()), x.shape, inverse)
            packed.tensors["fill"] = dropped_means(x, present, feature)
            packed.meta["feature"] = feature
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        values = packed.tensors["values"]
        assert isinstance(values, torch.Tensor)
        if packed.meta["form"] == storage.DENSE:
            return values.to(packed.dtype)
        n = packed.numel
        if packed.meta["form"] == storage.BITMAP:
            mask = packed.tensors["mask"]
            assert isinstance(mask, torch.Tensor)
            mask = mask.to(values.device, non_blocking=True)
            flat = mask_scatter(mask, values.to(packed.dtype), n)
        else:
            offsets, counts = packed.tensors["offsets"], packed.tensors["counts"]
            assert isinstance(offsets, torch.Tensor) and isinstance(counts, torch.Tensor)
            offsets = offsets.to(values.device, non_blocking=True)
            counts = counts.to(values.device, non_blocking=True)
            flat = offsets_scatter(offsets, counts, values.to(packed.dtype), n)
        order = packed.meta["order"]
        assert order is None or isinstance(order, tuple)
        out = restore(flat, packed.shape, order)
        fill = packed.tensors.get("fill")
        if isinstance(fill, torch.Tensor):
            if packed.meta["form"] == storage.BITMAP:
                present = unpack_mask(mask, n)
            else:
                ones = torch.ones(values.numel(), dtype=packed.dtype, device=values.device)
                present = offsets_scatter(offsets, counts, ones, n) != 0
            feature = packed.meta["feature"]
            assert isinstance(feature, int)
            shape = [1] * out.dim()
            shape[feature] = fill.numel()
            fill_b = fill.to(packed.dtype).view(shape)
            out = torch.where(restore(present, packed.shape, order), out, fill_b)
        return out


def feature_dim(x: torch.Tensor, site: Site) -> int:
    """The axis a weight gradient contracts per output: a conv input's channel, else the last."""
    return 1 if site.op == "conv" and x.dim() > 2 else x.dim() - 1


def dropped_means(x: torch.Tensor, present: torch.Tensor, feature: int) -> torch.Tensor:
    """Float32 mean of the dropped entries of each feature (0 where a feature kept all)."""
    dims = [d for d in range(x.dim()) if d != feature]
    dropped = ~present
    total = torch.where(dropped, x, 0).sum(dims, dtype=torch.float32)
    count = dropped.sum(dims)
    return total / count.clamp(min=1)
