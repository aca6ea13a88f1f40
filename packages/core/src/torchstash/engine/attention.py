"""A fused attention's output and log-sum-exp under replay: recomputed from the call's stored
``q``, ``k``, ``v``, recorded once and rebuilt on the next steps without the op tracker.

On the full path the op tracker sees the call return, and only then turns the output and the
log-sum-exp (kept as they are when the kernel saved them) into recipes over the codes of
``q``, ``k``, ``v`` (:meth:`~.recompute.Recomputation._settle_fused_attention`); a call it
cannot replay (dropout, a mask its kernel does not take, a kernel not checked against stock)
turns the codes back into their tensors instead. A replayed forward sees only the saves. What
a recording holds instead: the positions of the three saves read, the kind of the call's
autograd node, the node's plain arguments (``dropout_p``, ``is_causal``, ``scale``) and its
edges to the nodes of ``q``, ``k`` and ``v``. The outputs are saved after the node is made, so
a replayed output is rebuilt only when its node is of the recorded kind, reads this step's
``q``, ``k`` and ``v`` and keeps the recorded arguments; anything else is a guard miss. The
codes of ``q``, ``k`` and ``v`` were made before their call could be checked: on a miss they
are turned back into their tensors (:attr:`Attend.exact`), so no call ever reads codes of
some beside exact others. A call with a mask keeps today's region (:mod:`.regions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..derive import FUSED, FUSED_ATTENTION, FusedAttention, Recipe
from .entries import RELEASED, Entry, Recomputed

_MISSING = object()


@dataclass(slots=True, eq=False)
class Attend:
    """A fused attention's output (``which`` 0) or log-sum-exp (1) as recorded."""

    #: the recipe of the recording's call, its replay left out (made anew each step)
    recipe: Recipe
    which: int
    #: the positions of the saves of ``q``, ``k``, ``v`` and the shapes the call saved them in
    sources: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    #: the call's node kind, how many edges it has, and its plain arguments
    node: Any
    edges: int
    checks: tuple[tuple[str, Any], ...]
    #: the kernel that replays it and the call's arguments
    kernel: Any
    arguments: tuple[tuple[str, Any], ...]
    #: whether the save's tensor has the call's node (the output; a log-sum-exp that takes
    #: no gradient has none, and waits for the output's check: :attr:`Call.unchecked`)
    checked: bool = True
    #: the first of the call's two saves makes the replay, the last ends the call
    first: bool = False
    last: bool = False

    def signature(self) -> tuple[Any, ...]:
        return (
            self.which,
            self.sources,
            tuple(tuple(s) for s in self.shapes),
            self.node,
            self.edges,
            self.checks,
            self.kernel,
            self.arguments,
            self.recipe.autocast,
            self.checked,
            self.first,
            self.last,
        )


def plain_arguments(node: Any) -> tuple[tuple[str, Any], ...]:
    """The arguments an autograd node keeps that are not tensors (reading a saved tensor
    would unpack it): ``_saved_x`` without a ``_raw_saved_x``."""
    names = set(dir(node))
    return tuple(
        (name, getattr(node, name))
        for name in sorted(names)
        if name.startswith("_saved_") and f"_raw{name}" not in names
    )


def record(
    values: Sequence[Recomputed],
    saved: Sequence[Any],
    sources: Sequence[int],
    nodes: dict[int, Any],
) -> list[Attend] | None:
    """The recorded form of a fused attention call's two outputs, kept as ``values`` (recipes
    over the entries at ``sources``) and saved with the autograd nodes ``saved`` (the call's
    node, or None for a log-sum-exp that takes no gradient); None where a replay could not
    rebuild them (a mask, which is this step's tensor; a node that does not read the saves)."""
    if len(values) != 2 or len(sources) != 3:
        return None
    found_replay = values[0].recipe.arguments.get("replay")
    if not isinstance(found_replay, FusedAttention) or found_replay.mask is not None:
        return None
    replay: FusedAttention = found_replay
    found = [n for n in saved if n is not None]
    if len(found) != 1:
        return None
    node: Any = found[0]
    if FUSED_ATTENTION.get(node.name()) is None:
        return None
    nexts = node.next_functions
    if len(nexts) < 3:
        return None
    for k, p in enumerate(sources):
        if nodes.get(p, _MISSING) is not nexts[k][0]:
            return None
    arguments = (
        ("dropout_p", replay.dropout_p),
        ("is_causal", replay.is_causal),
        ("scale", replay.scale),
    )
    checks = plain_arguments(node)
    out = []
    for value, mine in zip(values, saved, strict=True):
        recipe = value.recipe
        if recipe.op != FUSED or recipe.arguments.get("replay") is not replay:
            return None
        out.append(
            Attend(
                dataclasses.replace(recipe, arguments={}),
                int(recipe.arguments["which"]),
                tuple(sources),
                tuple(shape for _, shape in value.sources),
                type(node),
                len(nexts),
                checks,
                replay.kernel,
                arguments,
                checked=mine is not None,
            )
        )
    out[0].first = out[-1].last = True
    return out


@dataclass(slots=True, eq=False)
class Call:
    """The fused attention call being replayed on a thread: its replay, whether its node was
    checked, and what was made before it was (the codes of its ``q``, ``k``, ``v``, a
    log-sum-exp with no node), each to be turned back into its tensor on a miss."""

    replay: FusedAttention | None = None
    node: Any = None
    #: (entry, the tensor it stands for, the bytes its move counted: stored, held)
    unchecked: list[tuple[Entry, torch.Tensor, int, int]] | None = None

    def hold(self, entry: Entry, t: torch.Tensor, stored: int, held: int) -> None:
        if self.unchecked is None:
            self.unchecked = []
        self.unchecked.append((entry, t, stored, held))


def rebuild(
    a: Attend,
    t: torch.Tensor,
    entries: dict[int, Entry],
    nodes: dict[int, Any],
    call: Call,
) -> Recomputed | None:
    """This step's value of a recorded fused attention output ``t``, or None on a guard
    miss. The caller holds it in ``call`` until the call's node is checked."""
    node: Any = t.grad_fn
    if a.checked:
        if type(node) is not a.node:
            return None
        nexts = node.next_functions
        if len(nexts) != a.edges:
            return None
        for k, p in enumerate(a.sources):
            if nodes.get(p, _MISSING) is not nexts[k][0]:
                return None
        for name, value in a.checks:
            if getattr(node, name, _MISSING) != value:
                return None
        call.node = node
    elif node is not None:
        return None
    if a.first:
        call.replay = FusedAttention(a.kernel, dict(a.arguments))
    elif call.replay is None:
        return None
    if a.last and call.node is None:
        return None  # neither save had the call's node
    sources = []
    for p, shape in zip(a.sources, a.shapes, strict=True):
        source = entries.get(p)
        if source is None or source.value is RELEASED:
            return None
        sources.append((source, shape))
    for source, _ in sources:
        source.pending += 1
    recipe = object.__new__(Recipe)
    recipe.__dict__.update(a.recipe.__dict__)
    recipe.arguments = {"replay": call.replay, "which": a.which}
    return Recomputed(sources, recipe, t.shape)


__all__ = ["Attend", "Call", "plain_arguments", "rebuild", "record"]
