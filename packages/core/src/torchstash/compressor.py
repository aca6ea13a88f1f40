"""The compressor protocol, a convenient base class, and composition of two compressors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from .packed import Packed
from .site import Site


class _AsIs:
    def __repr__(self) -> str:
        return "torchstash.AS_IS"


#: What a factory returns to store saved tensors as they are (``none``, ``quant.L0``). A
#: factory returning None is an error: that is most often a missing ``return``.
AS_IS: Any = _AsIs()


#: One tensor's code, everything about it decided but the tensor (see :class:`Compressor`)
Encoder = Callable[[torch.Tensor], "Packed | torch.Tensor"]


@runtime_checkable
class Compressor(Protocol):
    """Turns a saved tensor into a :class:`Packed` record and back.

    ``compress`` may decline a tensor by returning it unchanged; ``unsupported`` says why in
    advance (an empty list means it will compress). Stateful compressors key their state by
    ``site.key``. An op-aware compressor that stores a tensor differently depending on the op
    (a ReLU's sign mask instead of its values) also defines ``variant(x, site) -> str``, so
    the engine shares one stored copy of a tensor only between saves of the same variant.
    Two more optional methods concern outputs the engine recomputes (:mod:`.derive`):
    ``derivable(x, site) -> bool`` says a code may stand in for the op's output, and
    ``derived(x, site, sources)`` is told of each save kept as a recomputation from the
    entries stored at the ``sources`` sites (a budget then counts it: it costs no bytes).
    ``derives_op(op, reader=None) -> bool`` declines an op's output as a recomputation, for
    every reader or for one (an activation's input kept at its own, wider code rather than
    recomputed from a BatchNorm's narrower one): eager and compiled follow it alike.
    A compressor whose ``compress`` reads nothing of the site's op call, and whose code of a
    tensor of one shape, dtype and layout always takes the same bytes, sets ``replays = True``
    (or says so per save, ``replays_at(x, site) -> bool``, asked while the call runs): the
    engine then replays its decision on later steps without the op tracker, calling
    ``compress`` with the site less its call (:mod:`torchstash.engine.replay`). A code that
    reads plain values of the call (a max pool's geometry) and checks its own result defines
    ``recall(x, site) -> object``: asked while the call runs, its answer comes back on each
    replayed save as ``site.recalled``. A replayed save calls ``encoder(x, site)``'s answer
    where a compressor has one: ``compress(x, site)`` as a call of the tensor alone, with
    what it decides from the site, shape, dtype and layout (all the same on a replayed save)
    decided once. One whose
    widths change now and then (an allocation) also defines ``replays_next() -> bool``: False
    sends the next forward down the full path and records it anew. A compressor whose codes
    run inside a compiled graph (:mod:`.graphhooks`: torch ops, kernels with fake kernels,
    nothing read on the host) sets ``traceable = True``, or says why not per setting with
    ``graph_refusal(budgeted) -> str | None`` (``budgeted``: the model is applied with
    ``compile_budget``, so the partitioner recomputes before the codes). One whose
    ``derivable`` lets outputs be recomputed sets ``derive = True``: a compiled graph then
    recomputes them too (:func:`derives`, :mod:`.graphkeep`).
    """

    name: str
    lossless: bool

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]: ...

    def compress(self, x: torch.Tensor, site: Site) -> Packed | torch.Tensor: ...

    def decompress(self, packed: Packed) -> torch.Tensor: ...


class BaseCompressor:
    """Shared defaults: floating tensors only, no state. Subclasses set ``name``/``lossless``."""

    name: str = ""
    lossless: bool = False
    #: payload keys a following compressor may compress further (None: every float payload)
    composable: tuple[str, ...] | None = None
    #: its code of a save depends only on the tensor and the site's names, not on the op
    #: call's arguments or on earlier steps: a recorded decision may be replayed
    replays: bool = False

    def replays_at(self, x: torch.Tensor, site: Site) -> bool:
        """Whether this save's code may be replayed (see :class:`Compressor`)."""
        return self.replays

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        reasons = []
        if not (x.is_floating_point() or x.is_complex()):
            reasons.append(f"{self.name} compresses floating tensors, got {x.dtype}")
        if x.is_complex():
            reasons.append(f"{self.name} does not handle complex tensors")
        return reasons

    def compress(self, x: torch.Tensor, site: Site) -> Packed | torch.Tensor:
        raise NotImplementedError

    def decompress(self, packed: Packed) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class Composed:
    """``first`` then ``then`` on ``first``'s payload (e.g. dropit.mink's kept values to int8)."""

    def __init__(self, first: Compressor, then: Compressor) -> None:
        self.first = first
        self.then = then
        self.name = f"{first.name}>{then.name}"
        self.lossless = bool(first.lossless and then.lossless)

    def unsupported(self, x: torch.Tensor, site: Site) -> list[str]:
        return self.first.unsupported(x, site)

    # ``first``'s optional methods hold for the composition: it stores what ``first`` stores.
    def variant(self, x: torch.Tensor, site: Site) -> str:
        told = getattr(self.first, "variant", None)
        return str(told(x, site)) if told is not None else ""

    def derivable(self, x: torch.Tensor, site: Site) -> bool:
        told = getattr(self.first, "derivable", None)
        return bool(told(x, site)) if told is not None else False

    def derived(self, x: torch.Tensor, site: Site, sources: list[Site]) -> None:
        told = getattr(self.first, "derived", None)
        if told is not None:
            told(x, site, sources)

    def replays_at(self, x: torch.Tensor, site: Site) -> bool:
        """``then`` codes payloads not seen here: replayed only when it always replays."""
        return replays_at(self.first, x, site) and bool(getattr(self.then, "replays", False))

    def replays_next(self) -> bool:
        return replays_next(self.first) and replays_next(self.then)

    def compress(self, x: torch.Tensor, site: Site) -> Packed | torch.Tensor:
        packed = self.first.compress(x, site)
        if not isinstance(packed, Packed):
            return packed
        keys = getattr(self.first, "composable", None)
        for key, value in list(packed.tensors.items()):
            if isinstance(value, Packed) or (keys is not None and key not in keys):
                continue
            inner_site = dataclasses.replace(site, role=f"{site.role}/{key}")
            if value.numel() == 0 or self.then.unsupported(value, inner_site):
                continue
            packed.tensors[key] = self.then.compress(value, inner_site)
        return packed

    def decompress(self, packed: Packed) -> torch.Tensor:
        inner = {
            k: self.then.decompress(v) if isinstance(v, Packed) else v
            for k, v in packed.tensors.items()
        }
        return self.first.decompress(dataclasses.replace(packed, tensors=inner))

    def __repr__(self) -> str:
        return f"<Composed {self.name}>"


class AtSite:
    """``compress(x, site)`` at one site, as a call of ``x`` alone (a compressor's encoder
    where it settles nothing beforehand)."""

    __slots__ = ("compress", "site")

    def __init__(self, compress: Callable[[torch.Tensor, Site], Packed | torch.Tensor], site: Site):
        self.compress, self.site = compress, site

    def __call__(self, x: torch.Tensor) -> Packed | torch.Tensor:
        return self.compress(x, self.site)


def encoder_of(compressor: Compressor, x: torch.Tensor, site: Site) -> Encoder:
    """What a replayed save of ``x``'s site, shape, dtype and layout calls to code a tensor
    as ``compressor.compress(x, site)`` does: its ``encoder(x, site)``, else its compress
    at the site."""
    told = getattr(compressor, "encoder", None)
    if told is not None:
        return told(x, site)
    return AtSite(compressor.compress, site)


def replays_at(compressor: Compressor, x: torch.Tensor, site: Site) -> bool:
    """Whether ``compressor``'s code of ``x`` at ``site`` (its call running) may be replayed on
    later steps: its ``replays_at``, else its ``replays`` flag (see :class:`Compressor`)."""
    told = getattr(compressor, "replays_at", None)
    if told is not None:
        return bool(told(x, site))
    return bool(getattr(compressor, "replays", False))


def replays_next(compressor: Compressor) -> bool:
    """Whether the next forward may replay ``compressor``'s codes (see :class:`Compressor`)."""
    told = getattr(compressor, "replays_next", None)
    return bool(told()) if told is not None else True


#: what a compressor that says nothing of compiled graphs is told (see :func:`graph_refusal`)
NOT_TRACEABLE = "its codes have no traced form (torch ops only): it compresses in Python hooks"


def graph_refusal(compressor: Compressor, budgeted: bool) -> str | None:
    """Why a compiled graph does not run ``compressor``'s codes, None where it does: its
    ``graph_refusal``, else its ``traceable`` flag (see :class:`Compressor`), after its name."""
    told = getattr(compressor, "graph_refusal", None)
    if told is not None:
        why = told(budgeted)
    else:
        why = None if getattr(compressor, "traceable", False) else NOT_TRACEABLE
    if why is None:
        return None
    name = getattr(compressor, "name", type(compressor).__name__)
    return why if why.startswith(f"{name}: ") else f"{name}: {why}"


def derives(compressor: Compressor) -> bool:
    """Whether ``compressor`` lets outputs be recomputed from its codes (``derivable`` and a
    true ``derive``, see :class:`Compressor`): a compiled graph then recomputes a GELU's or a
    LayerNorm's output from its coded input, as the eager engine does."""
    return bool(getattr(compressor, "derive", False)) and callable(
        getattr(compressor, "derivable", None)
    )


def recomputed_ops(compressor: Compressor, ops: Iterable[str]) -> frozenset[str]:
    """Those of ``ops`` whose outputs a compiled graph recomputes from ``compressor``'s codes,
    as the eager engine does: all where it :func:`derives`, less those its optional
    ``derives_op(op) -> bool`` declines (a BatchNorm's input coded too coarsely to stand in
    for the output); none where it does not derive."""
    if not derives(compressor):
        return frozenset()
    told = getattr(compressor, "derives_op", None)
    return frozenset(op for op in ops if told is None or told(op))


def declined_readers(compressor: Compressor, ops: Iterable[str]) -> frozenset[tuple[str, str]]:
    """The pairs ``(op, reader)`` of ``ops`` where ``compressor`` recomputes ``op``'s output but
    not as ``reader``'s saved input (``derives_op(op, reader)`` false): that input is then
    saved and coded as the reader's own, eagerly (:func:`recomputes_into`) and compiled."""
    told = getattr(compressor, "derives_op", None)
    if told is None or not derives(compressor):
        return frozenset()
    ops = tuple(ops)
    return frozenset(
        (op, reader)
        for op in ops
        for reader in ops
        if op != reader and told(op) and not told(op, reader)
    )


def recomputes_into(compressor: Compressor, op: str, reader: str) -> bool:
    """Whether the eager engine may keep ``reader``'s saved input, ``op``'s output, as a
    recomputation from ``compressor``'s code of ``op``'s input (``derives_op``; default yes)."""
    told = getattr(compressor, "derives_op", None)
    return told is None or bool(told(op, reader))
