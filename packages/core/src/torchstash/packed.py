"""The one record every compressor produces: what was saved, and the payload that stands for it.

One shape for every codec keeps accounting, offloading and tests generic. A payload entry is a
tensor, or another ``Packed`` when a second compressor was applied to it (composition).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Union

import torch

Payload = Union[torch.Tensor, "Packed"]
Setting = int | float | bool | str | None | tuple[int, ...]


@dataclass(eq=False)
class Packed:
    codec: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    tensors: dict[str, Payload] = field(default_factory=dict)
    meta: dict[str, Setting] = field(default_factory=dict)

    @classmethod
    def like(cls, x: torch.Tensor, codec: str, **tensors: Payload) -> Packed:
        """A record for ``x`` with the given payload (settings added through ``meta``)."""
        return cls(codec, x.shape, x.dtype, x.device, dict(tensors))

    def nbytes(self) -> int:
        """Bytes held by the payload (storage actually referenced, counted once per tensor)."""
        return sum(_payload_nbytes(p) for p in self.tensors.values())

    def payload_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor held, nested records included."""
        for p in self.tensors.values():
            if isinstance(p, Packed):
                yield from p.payload_tensors()
            else:
                yield p

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={_short(v)}" for k, v in self.tensors.items())
        return f"Packed({self.codec}, shape={tuple(self.shape)}, dtype={self.dtype}, {inner}, nbytes={self.nbytes()})"


def _payload_nbytes(p: Payload) -> int:
    if isinstance(p, Packed):
        return p.nbytes()
    return p.numel() * p.element_size()


def _short(p: Payload) -> str:
    if isinstance(p, Packed):
        return repr(p)
    return f"{p.dtype}{list(p.shape)}"


def raw_nbytes(x: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (not of a larger storage it may view)."""
    return x.numel() * x.element_size()


def storage_base(t: torch.Tensor) -> int:
    """Address of the storage a tensor views (cheap: no storage object is made)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()
