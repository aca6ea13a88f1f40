"""The one record every compressor produces: what was saved, and the payload that stands for it.

One shape for every codec keeps accounting, offloading and tests generic. A payload entry is a
tensor, or another ``Packed`` when a second compressor was applied to it (composition).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch.multiprocessing.reductions import StorageWeakRef

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

    def nbytes(self, device_type: str | None = None) -> int:
        """Bytes the payload holds: each payload tensor's storage at its full size, once however
        many payload tensors view it (a slice of a padded buffer holds the whole buffer), nested
        records included. With ``device_type`` (``"cpu"``), only the storages there."""
        return sum(
            nbytes
            for nbytes, device in _storages(self.payload_tensors()).values()
            if device_type is None or device.type == device_type
        )

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


def _short(p: Payload) -> str:
    if isinstance(p, Packed):
        return repr(p)
    return f"{p.dtype}{list(p.shape)}"


def raw_nbytes(x: torch.Tensor) -> int:
    """Bytes of the tensor's own elements (not of a larger storage it may view): the size the
    engine's ``min_bytes`` threshold reads. What holding the tensor costs is
    :func:`storage_nbytes`."""
    return x.numel() * x.element_size()


def storage_base(t: torch.Tensor) -> int:
    """Address of the storage a tensor views (cheap: no storage object is made)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage ``t`` views, or None where there is no single one to count (a sparse or
    nested tensor, a tensor subclass without storage) or it is not memory (a meta tensor)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage if storage.data_ptr() or not storage.nbytes() else None


def storage_nbytes(t: torch.Tensor) -> int:
    """Bytes that holding ``t`` keeps alive: its whole storage (a view or slice of a larger
    tensor holds all of it), or its own elements where it has no storage to count."""
    storage = _storage(t)
    return raw_nbytes(t) if storage is None else storage.nbytes()


def _storages(tensors: Iterable[torch.Tensor]) -> dict[object, tuple[int, torch.device]]:
    """Each distinct storage among ``tensors``: its bytes and device (storage-less tensors
    are counted by their elements, each on its own)."""
    found: dict[object, tuple[int, torch.device]] = {}
    for t in tensors:
        storage = _storage(t)
        if storage is None:
            found[id(t)] = (raw_nbytes(t), t.device)
        else:
            found[(storage.data_ptr(), t.device)] = (storage.nbytes(), t.device)
    return found


class StorageLedger:
    """Storages counted once while the one that counted them holds them.

    Stock PyTorch keeps a saved tensor's storage, whole, once however many saved tensors view
    it (``q``, ``k`` and ``v`` sliced from one projection; an attention output and the
    reshaped view of it the next projection saves). :meth:`count` is the bytes of a tensor's
    storage when no live owner counted it yet, and 0 when one did. A record lapses when its
    owner is gone (a freed graph's entry) or its storage was freed (the address may then hold
    another storage).
    """

    def __init__(self) -> None:
        self._records: dict[tuple[int, torch.device], tuple[weakref.ref[Any], StorageWeakRef]] = {}
        self._limit = 1024

    def count(self, t: torch.Tensor | Packed, owner: object) -> int:
        """Bytes of ``t``'s storage (a record's: of each payload storage) not yet counted for
        a live owner; they are counted for ``owner`` (held weakly) from now on."""
        if isinstance(t, Packed):
            return sum(self.count(p, owner) for p in t.payload_tensors())
        storage = _storage(t)
        if storage is None:
            return raw_nbytes(t)
        key = (storage.data_ptr(), t.device)
        record = self._records.get(key)
        if record is not None and record[0]() is not None and not record[1].expired():
            return 0
        self._records[key] = (weakref.ref(owner), StorageWeakRef(storage))
        if len(self._records) > self._limit:
            self._prune()
        return storage.nbytes()

    def release(self, t: torch.Tensor, owner: object) -> int:
        """Bytes of ``t``'s storage that ``owner`` counted, now no longer counted (0 when
        another owner counted it): for an entry that gave its tensor up."""
        storage = _storage(t)
        if storage is None:
            return 0
        key = (storage.data_ptr(), t.device)
        record = self._records.get(key)
        if record is None or record[0]() is not owner or record[1].expired():
            return 0
        del self._records[key]
        return storage.nbytes()

    def _prune(self) -> None:
        records = self._records
        for key in [k for k, (o, s) in records.items() if o() is None or s.expired()]:
            del records[key]
        self._limit = max(1024, 2 * len(records))
