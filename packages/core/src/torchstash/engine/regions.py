"""Parts of a replayed forward left to the full path: the module calls whose saves read the
op call.

Some decisions cannot be replayed from a record: a code that reads its op's arguments (which
operand of an attention's matmul a tensor is, a fused attention's mask) and a recipe the
replay cannot check (an attention map recomputed from ``q`` and ``k`` through the scale, the
mask and the softmax). A recording used to send the whole forward down the full path for one
such save. Instead it now marks a *region*: the innermost module call holding that save and
everything the save depends on (the saves it shares, or is recomputed from), widened until
every save inside depends only on saves inside. On a replayed step the engine enters the op
tracker for a region's call only (an attention module) and makes each of its saves as the
recording made it, reading from this call what the recording read from its own: a code's
variant must come out as recorded, and a recomputed save takes the recipe the tracker carried
this step over the entries at the recorded positions (``Engine._redo_in_region``). A save that
differs, or one of a kind this does not make (a fused attention's), is decided by the full
path and checked against the recording (what was stored, by which compressor, in how many
bytes). The rest of the forward replays. A region that would be the whole forward is no
region: that forward is not replayed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..packed import Packed

if TYPE_CHECKING:
    from .entries import Entry


class Frame(Protocol):
    """A module call on the recording's stack (:class:`~.scope.Frame`)."""

    owner: object
    call: int
    counts: dict[str, int] | None


class Placed(Protocol):
    """What :func:`place` reads and marks of a recorded save (:class:`~.replay.Move`)."""

    stack: tuple[Any, ...]
    deps: tuple[int, ...]
    needs_call: bool
    turned: bool
    full: bool

    @property
    def attend(self) -> object | None: ...  # a fused attention's output (:mod:`.attention`)


#: a region's key: the module's id and which call of it in the forward
Key = tuple[int, int]


@dataclass(frozen=True, slots=True, eq=False)
class Region:
    """A module call a replayed forward runs down the full path."""

    owner: weakref.ref[Any]
    call: int
    #: the forward's op counts when the call began (a site names its op by its index in the
    #: forward: the region's sites must be named as recorded)
    counts: dict[str, int]


def decided(entry: Entry, shared: bool) -> tuple[Any, ...]:
    """What the full path made of a save, as a replayed region's save must make it again:
    shared with an earlier save or not, kept as what, by which compressor, in which variant,
    in how many bytes."""
    value = entry.value
    nbytes = value.nbytes() if isinstance(value, Packed) else -1
    return (shared, type(value), id(entry.compressor), entry.variant, nbytes)


def _has(stack: tuple[Frame, ...], frame: Frame) -> bool:
    return any(f is frame for f in stack)


def _common(a: tuple[Frame, ...], b: tuple[Frame, ...]) -> tuple[Frame, ...]:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x is not y:
            break
        n += 1
    return a[:n]


def place(moves: Sequence[Placed]) -> dict[Key, Region] | None:
    """The regions of a recorded forward, marking ``full`` the moves the full path decides
        again: those whose decision read the op call, what they share or are recomputed from
        (the full path must have stored it to find it), and a save that turned one of those
        back into its tensor. None when a region would be the whole forward, or when most saves
    would be in one."""
    full = {i for i, m in enumerate(moves) if m.needs_call}
    changed = bool(full)
    while changed:
        changed = False
        for i, m in enumerate(moves):
            if i in full:
                new = [p for p in m.deps if p not in full]
            else:
                # a save turned back into its tensor, or a fused attention's output
                # rebuilt over saves the full path makes: the full path makes it too
                reads = m.turned or m.attend is not None
                new = [i] if reads and any(p in full for p in m.deps) else []
            if new:
                full.update(new)
                changed = True
    if 2 * len(full) > len(moves):
        return None  # most saves read the call: the full path costs no more than regions
    regions: dict[int, tuple[Frame, ...]] = {}  # id(frame) -> the stack down to it

    def region_of(stack: tuple[Frame, ...]) -> Frame | None:
        for f in stack:
            if id(f) in regions:
                return f
        return None

    for i in sorted(full):
        stack = moves[i].stack
        for p in moves[i].deps:  # the region holds the ops between them too
            stack = _common(stack, moves[p].stack)
        if len(stack) < 2:  # the outermost call: the whole forward
            return None
        if region_of(stack) is not None:
            continue
        frame = stack[-1]
        for k in [k for k, s in regions.items() if _has(s, frame)]:
            del regions[k]  # nested in the new one
        regions[id(frame)] = stack
    out: dict[Key, Region] = {}
    for stack in regions.values():
        frame = stack[-1]
        if frame.counts is None:
            return None
        try:
            owner = weakref.ref(frame.owner)
        except TypeError:
            return None
        out[(id(frame.owner), frame.call)] = Region(owner, frame.call, frame.counts)
    for i, m in enumerate(moves):
        m.full = i in full
    return out


__all__ = ["Frame", "Key", "Placed", "Region", "decided", "place"]
