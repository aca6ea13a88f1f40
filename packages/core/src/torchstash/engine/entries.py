"""What the engine keeps for one saved tensor: an entry (shared by every op that saved it),
the forward pass that stored it, and the handle autograd holds."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..compressor import Compressor
from ..derive import Recipe
from ..packed import Packed, raw_nbytes
from ..site import NO_CALL, OpCall, Site


class Recomputed:
    """An entry's value that is a recipe over other entries (see :mod:`.derive`)."""

    __slots__ = ("recipe", "shape", "sources")

    def __init__(
        self, sources: list[tuple[Entry, torch.Size]], recipe: Recipe, shape: torch.Size
    ) -> None:
        #: the operands' entries, each with the shape its op saved it in (kept alive as long
        #: as this save is)
        self.sources = sources
        self.recipe = recipe
        self.shape = shape


class Entry:
    """One stored tensor, shared by every op that saved it."""

    __slots__ = (
        "__weakref__",
        "cache",
        "compressor",
        "graph",
        "pending",
        "reason",
        "site",
        "source",
        "strides",
        "value",
        "variant",
        "version",
        "watch",
    )

    def __init__(
        self,
        value: torch.Tensor | Packed | Recomputed,
        compressor: Compressor | None,
        site: Site,
        version: int,
        source: torch.Tensor | None,
        variant: str = "",
        watched: torch.Tensor | None = None,
    ) -> None:
        self.value = value
        self.compressor = compressor
        self.variant = variant
        #: kept without its op call: the call's arguments must not outlive the call
        self.site = site if site.opcall is NO_CALL else without_call(site)
        self.version = version
        self.source: Callable[[], torch.Tensor | None] = (
            weakref.ref(source) if source is not None else _gone
        )
        #: the forward pass that stored it (None when shared with another pass)
        self.graph: Graph | None = None
        #: an empty tensor sharing the saved tensor's version counter (:func:`version_alias`),
        #: so an in-place change after the save is seen in backward as stock PyTorch sees it,
        #: without holding the memory a code replaced
        self.watch = version_alias(watched) if watched is not None else None
        #: restores still to come (saves and recipes that read it): a recomputed value is
        #: kept from its first restore until the last (an attention map is read by the
        #: softmax's backward, the matmul's and the recomputed projection input's)
        self.pending = 0
        self.cache: torch.Tensor | None = None
        #: why it is stored as it is (counted in its row's ``declined``), or ""
        self.reason = ""
        #: the saved tensor's strides, which a code or a recipe restores (see
        #: :func:`torchstash.layout.with_layout`); None when kept as is or not dense
        self.strides: tuple[int, ...] | None = None

    @classmethod
    def kept(cls, value: torch.Tensor | Packed | Recomputed, site: Site, version: int) -> Entry:
        """An entry holding ``value`` as it is, for a site kept without its call: the
        replayed path's (:mod:`.replay`), which builds one per save and shares none."""
        entry = cls.__new__(cls)
        entry.value = value
        entry.compressor = None
        entry.variant = ""
        entry.site = site
        entry.version = version
        entry.source = _gone
        entry.graph = None
        entry.watch = None
        entry.pending = 0
        entry.cache = None
        entry.reason = ""
        entry.strides = None
        return entry

    @classmethod
    def coded(
        cls,
        value: Packed | Recomputed,
        compressor: Compressor | None,
        site: Site,
        t: torch.Tensor,
        variant: str,
    ) -> Entry:
        """An entry holding a code or a recipe of ``t`` (which it does not hold, only its
        version counter): the replayed path's, one per save, shared by none."""
        entry = cls.kept(value, site if site.opcall is NO_CALL else without_call(site), t._version)
        entry.compressor = compressor
        entry.variant = variant
        entry.watch = version_alias(t)
        return entry

    def modified(self) -> int | None:
        """The saved tensor's version now, when an in-place op changed it since the save."""
        value = self.value
        watch = value if isinstance(value, torch.Tensor) else self.watch
        if watch is None or watch._version == self.version:
            return None
        return watch._version


def _gone() -> None:
    return None


def without_call(site: Site) -> Site:
    """``site`` without its op call (whose arguments must not outlive the call)."""
    return with_call(site, NO_CALL)


def with_call(site: Site, call: OpCall) -> Site:
    """``site`` with ``call`` as its op call: built field by field, three times faster than
    ``dataclasses.replace`` (a kept site with the running call: a replayed region's save,
    whose code or recipe reads the call, named as the recording named it)."""
    return Site(
        site.module,
        site.tag,
        site.module_type,
        site.module_index,
        site.op,
        site.func,
        site.op_index,
        site.role,
        site.ordinal,
        site.call,
        site.training,
        call,
        site.recalled,
    )


#: What a released entry holds: its backward failed, and its memory went back.
RELEASED = torch.empty(0)


class Graph:
    """The entries one forward pass stored, held weakly (the autograd graph owns them).

    When an error escapes an unpack hook the backward through that graph cannot finish; the
    entries are released at once, so an out-of-memory back-off gets the memory back even while
    the failed graph (``loss``) is still referenced.
    """

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: list[weakref.ref[Entry]] = []

    def release(self) -> tuple[int, int]:
        """Drop every entry's payload; returns (tensors, bytes) released."""
        count = nbytes = 0
        for ref in self.entries:
            entry = ref()
            if entry is None or entry.graph is not self or entry.value is RELEASED:
                continue
            value = entry.value
            if isinstance(value, Packed):
                nbytes += value.nbytes()
            elif isinstance(value, torch.Tensor):
                nbytes += raw_nbytes(value)
            count += 1
            entry.value = RELEASED
            entry.cache = None
            entry.source = _gone  # never shared again
        self.entries.clear()
        return count, nbytes


class Saved:
    """What the pack hook hands autograd: a reference to a (possibly shared) entry."""

    __slots__ = ("entry", "shape")

    def __init__(self, entry: Entry, shape: tuple[int, ...] | None = None) -> None:
        self.entry = entry
        #: set when this save is a reshaped view of the entry's tensor (same memory)
        self.shape = shape


def version_alias(t: torch.Tensor) -> torch.Tensor | None:
    """An empty tensor that shares ``t``'s version counter (and so its views' and base's):
    ``detach`` shares the counter, and assigning ``.data`` swaps the storage out without
    touching it. Holds no memory of ``t``'s. None for a tensor type that cannot do this."""
    try:
        alias = t.detach()
        alias.data = t.new_empty(0)
    except Exception:  # a tensor subclass or layout without .data: no check, as before
        return None
    return alias


def dedupe_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Saves with equal keys hold the same values. Contiguous tensors over the same memory
    match whatever their shape (``att`` and the ``(B*H, N, N)`` view matmul saves of it), so
    an attention map is stored once."""
    if t.is_contiguous():
        return (t.data_ptr(), t.dtype, t.device, t.numel(), t._version)
    return (t.data_ptr(), t.dtype, t.device, tuple(t.shape), t.stride(), t._version)


def variant_of(compressor: Compressor | None, t: torch.Tensor, site: Site) -> str:
    """How ``compressor`` stores ``t`` at ``site`` (optional ``variant`` method): entries are
    shared between saves of one tensor only when this agrees."""
    variant = getattr(compressor, "variant", None)
    return variant(t, site) if variant is not None else ""
