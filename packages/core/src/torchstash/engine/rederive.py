"""Recomputed saves under replay: a BatchNorm's or LayerNorm's output (or a SiLU's) that a
later op saves, kept as a recipe over the op's stored input, recorded once and rebuilt on the
next steps without the op tracker.

On the full path the tracker sees the op's call (its weight and bias, the statistics it
saved) and its result, so the later save is matched to the output by identity
(:mod:`.recompute`). A replayed forward sees only the saves. What a recording holds instead:
which earlier saves of the forward are the operand and the statistics (the moves at those
positions), the recipe's arguments (parameters and buffers only, the same objects each step),
and the path through autograd's graph from the later save's node to the op's node and on to
the operand's node (node types and edges: a ReLU in place after a BatchNorm is one step).
A replayed save is rebuilt only when that path leads, node type by node type, to the very
node that made this step's operand, and the op's node reads the recorded parameters (its
edges to their gradient accumulators); anything else is a guard miss, kept exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..derive import SDPA, Recipe, Replay
from ..packed import storage_base
from .entries import RELEASED, Entry, Recomputed


class Positions(Protocol):
    """What :func:`record` reads of the recording (:class:`~.replay.Recorder`): where each
    entry and statistic was stored, and the autograd node of each stored tensor."""

    nodes: dict[int, Any]

    def position(self, entry: Entry) -> int: ...

    def position_of_value(self, value: torch.Tensor) -> int: ...


#: ops of one operand whose recipe reads parameters, the saved statistics and plain values
#: the op's node keeps (a GELU's ``approximate``), and a fused attention's output as a later
#: op saves it (its recipe is the output's layout steps; the output is itself rebuilt by
#: :mod:`.attention`); a matmul's two operands are not replayed
REPLAYED_OPS = frozenset({"batch_norm", "layer_norm", "silu", "hardswish", "gelu", SDPA})

#: edges walked from the later save's node to the op's node, at most, beyond the recipe's
#: carried steps (views and aliases between them carry no step: Hugging Face's GPT-2 feeds its
#: projections a view of an alias of a view of the LayerNorm's output)
EXTRA_DEPTH = 4

#: (node type, the edge taken): from the later save's node to the operand's
Path = tuple[tuple[Any, int], ...]


@dataclass(slots=True, eq=False)
class Rederive:
    """A recomputed save as recorded: what a replay needs to rebuild it, and checks."""

    #: the recipe with its statistics left out (this step's are the statistics' moves')
    recipe: Recipe
    #: the operand's move and the shape its op saved it in
    source: int
    shape: torch.Size
    #: the statistics' moves, in the recipe's order
    stats: tuple[int, ...]
    #: autograd's graph from the save's node to the operand's node
    path: Path
    #: the op node's edges to its parameters' gradient accumulators: (edge, parameter)
    edges: tuple[tuple[int, torch.Tensor], ...]
    #: arguments without a gradient (frozen weights, buffers): still the model's state
    frozen: tuple[torch.Tensor, ...]
    #: the plain arguments, as the op's node keeps them (``_saved_approximate``)
    checks: tuple[tuple[str, Any], ...] = ()

    def signature(self) -> tuple[Any, ...]:
        r = self.recipe
        steps = tuple(
            (s.func, tuple(s.args), tuple(sorted(s.kwargs.items())), s.index, s.autocast)
            for s in r.steps
            if isinstance(s, Replay)
        )
        return (
            r.op,
            tuple((k, id(v)) for k, v in r.arguments.items()),
            r.dtype,
            r.shape,
            r.arity,
            r.autocast,
            steps,
            self.source,
            tuple(self.shape),
            self.stats,
            self.path,
            tuple((k, id(p)) for k, p in self.edges),
            tuple(id(p) for p in self.frozen),
            self.checks,
        )


def record(
    value: Recomputed,
    t: torch.Tensor,
    rec: Positions,
    is_state: Callable[[torch.Tensor], bool],
) -> Rederive | None:
    """The recorded form of the save ``t`` kept as ``value``, or None where a replay could
    not rebuild it (the recording then refuses)."""
    recipe = value.recipe
    if recipe.op not in REPLAYED_OPS or recipe.arity != 1 or len(value.sources) != 1:
        return None
    for step in recipe.steps:  # a mask or a scale held: this step's, not the next one's
        if not isinstance(step, Replay) or step.held or step.constants:
            return None
    arguments, plain = [], []
    for name, a in recipe.arguments.items():
        if a is None:
            continue
        if not isinstance(a, torch.Tensor):
            plain.append((f"_saved_{name}", a))
        elif not is_state(a):
            return None
        else:
            arguments.append(a)
    ((entry, shape),) = value.sources
    source = rec.position(entry)
    if source < 0 or rec.nodes.get(source) is None:
        return None
    stats = []
    for s in recipe.stats:
        p = rec.position_of_value(s)
        if p < 0:
            return None
        stats.append(p)
    path = _path(t.grad_fn, operand_node(rec.nodes[source]), len(recipe.steps) + EXTRA_DEPTH)
    if path is None:
        return None
    op_node = _walk(t.grad_fn, path[:-1])
    assert op_node is not None
    missing = object()
    if any(getattr(op_node, name, missing) != value for name, value in plain):
        return None  # a plain argument the node does not keep: nothing to check it by
    edges, frozen = [], []
    nexts = op_node.next_functions
    for a in arguments:
        k = next(
            (
                k
                for k, (n, _) in enumerate(nexts)
                if n is not None and getattr(n, "variable", None) is a
            ),
            -1,
        )
        if k >= 0:
            edges.append((k, a))
        elif a.requires_grad:
            return None  # a weight with a gradient the op's node does not read: not its own
        else:
            frozen.append(a)
    template = dataclasses.replace(recipe, stats=[])
    return Rederive(
        template, source, shape, tuple(stats), path, tuple(edges), tuple(frozen), tuple(plain)
    )


def rebuild(
    d: Rederive,
    t: torch.Tensor,
    entries: dict[int, Entry],
    nodes: dict[int, Any],
    state: Callable[[], set[int]],
) -> Recomputed | None:
    """This step's value of a recorded recomputed save ``t``, or None on a guard miss."""
    target = operand_node(nodes.get(d.source))
    node = _walk(t.grad_fn, d.path[:-1])
    if node is None or target is None:
        return None
    kind, k = d.path[-1]
    if type(node) is not kind:
        return None
    nexts = node.next_functions
    if k >= len(nexts) or nexts[k][0] is not target:
        return None
    for k, p in d.edges:
        if k >= len(nexts) or getattr(nexts[k][0], "variable", None) is not p:
            return None
    for name, value in d.checks:
        if getattr(node, name, None) != value:
            return None
    if d.frozen:
        live = state()
        if any(storage_base(a) not in live for a in d.frozen):
            return None
    source = entries.get(d.source)
    if source is None or source.value is RELEASED:
        return None
    stats = []
    for p in d.stats:
        kept = entries.get(p)
        if kept is None or not isinstance(kept.value, torch.Tensor) or kept.value is RELEASED:
            return None
        stats.append(kept.value)
    recipe = d.recipe.with_stats(stats)
    source.pending += 1
    return Recomputed([(source, d.shape)], recipe, t.shape)


def operand_node(node: Any) -> Any:
    """The node of the op's operand as its output's graph reaches it: for the copy an
    in-place SiLU or Hardswish saves of its input (a clone), the node of what it copied."""
    if type(node).__name__ == "CloneBackward0" and node.next_functions:
        return node.next_functions[0][0]
    return node


def _walk(node: Any, path: Path) -> Any:
    """The node reached from ``node`` along ``path`` (types checked), or None."""
    for kind, k in path:
        if node is None or type(node) is not kind:
            return None
        nexts = node.next_functions
        if k >= len(nexts):
            return None
        node = nexts[k][0]
    return node


def _path(start: Any, target: Any, depth: int) -> Path | None:
    """The shortest path of edges from ``start`` to ``target`` in autograd's graph, at most
    ``depth`` long, or None."""
    if start is None or target is None:
        return None
    frontier: list[tuple[Any, Path]] = [(start, ())]
    for _ in range(depth):
        grown = []
        for node, path in frontier:
            for k, (n, _) in enumerate(node.next_functions):
                if n is None:
                    continue
                step = (*path, (type(node), k))
                if n is target:
                    return step
                grown.append((n, step))
        frontier = grown
    return None
