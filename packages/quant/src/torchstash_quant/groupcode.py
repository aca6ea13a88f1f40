"""How one tensor is coded by a group codec, as a typed value rather than keyword arguments.

quant's value codecs (:class:`~.groupwise.GroupQuantizer`, :class:`~.auto.AutoQuantizer`)
code each tensor in groups with a width; :class:`~.opaware.OpAware` asks for another width,
group size or row centering per tensor (attention at ``attn_bits``, groups aligned to a
normalization's rows, the rows centered on their offsets). It says so with a
:class:`GroupCode`, to a codec that declares it takes one (:class:`GroupCodec`), instead of
widening the compressor protocol with keyword arguments. The record (``Packed.meta``) keeps
what was used, so the decoder needs nothing but the record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from torchstash.compressor import Compressor
from torchstash.packed import Packed
from torchstash.site import Site


@dataclass(frozen=True, slots=True)
class GroupCode:
    """One tensor's code where it differs from the codec's own settings (None: the codec's).

    ``bits``: the width; ``group_size``: elements per group (kept inside rows by the
    caller); ``rows``: the tensor less each ``rows``-element row's offset is coded, the
    offsets in the record (:mod:`.centered`)."""

    bits: int | None = None
    group_size: int | None = None
    rows: int | None = None


#: the codec's own settings
OWN = GroupCode()


@runtime_checkable
class GroupCodec(Compressor, Protocol):
    """A value codec that also codes a tensor as a :class:`GroupCode` says."""

    group_size: int

    def compress_as(self, x: torch.Tensor, site: Site, code: GroupCode) -> Packed: ...

    def encoder_as(self, site: Site, code: GroupCode) -> Callable[[torch.Tensor], Packed]:
        """``compress_as(x, site, code)`` as a call of ``x`` alone, whatever it could settle
        beforehand settled (a replayed save calls it)."""
        ...
