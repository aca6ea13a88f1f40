"""What a partitioner that recomputes under a memory budget must still save: the values the
eager engine keeps exact.

With ``apply(..., compile_budget=)`` the partitioner recomputes the cheapest values in
backward from what it saves, and the strategy codes what it saves. A value recomputed from a
code is the code's, not stock's: a BatchNorm's statistics recomputed from its coded input, or a
ReLU's output (whose mask its backward reads) from a coded BatchNorm input. The zoo's ResNet
under ``quant.int4`` at budget 0.5 came to gradient cosine 0.72 with stock's (eager 0.989).
This joint-graph pass marks those values ``MUST_SAVE`` before the partitioner runs, as
selective checkpointing's policy would: statistics are small and kept exact, a ReLU's output
keeps its signs exact beside its code (:mod:`torchstash.graphhooks`). With it: 0.993.

It runs as AOTAutograd's ``joint_custom_pass``, before any backend's partitioner (inductor's,
``aot_eager_decomp_partition``'s, a custom backend's): a budget honoured by a backend other
than inductor keeps the same values exact.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

aten = torch.ops.aten

#: normalizations whose outputs 1 and 2 are the statistics their backward reads
_NORMS = frozenset(
    {
        aten.native_batch_norm.default,
        aten._native_batch_norm_legit.default,
        aten._native_batch_norm_legit_functional.default,
        aten._native_batch_norm_legit_no_training.default,
        aten.native_layer_norm.default,
        aten.native_group_norm.default,
    }
)
#: ops whose output's sign is what their backward reads
_MASKS = frozenset({aten.relu.default})


def kept_exactly(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value (a forward node's) is one a recomputation from a code must not
    stand in for: a ReLU's output, a normalization's statistics, any reduction's result (a
    decomposed normalization's mean and variance, a softmax's maximum and sum: small values
    eager keeps exact; what is computed from them pointwise, an ``rsqrt``, is then recomputed
    exactly)."""
    if node.op != "call_function":
        return False
    if node.target in _MASKS or _reduces(node):
        return True
    if node.target is operator.getitem and len(node.args) == 2:
        source, index = node.args
        if not isinstance(source, torch.fx.Node):
            return False
        return _reduces(source) or (source.target in _NORMS and index in (1, 2))
    return False


def _reduces(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.reduction in tags


def forward_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """A joint graph's forward: the nodes that read no tangent, in order."""
    backward: set[torch.fx.Node] = set()
    found = []
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            a in backward for a in node.all_input_nodes
        ):
            backward.add(node)
        elif node.op == "call_function":
            found.append(node)
    return found


def keep_exact(graph: torch.fx.Graph) -> None:
    """Marks the :func:`kept_exactly` values of a joint graph's forward ``MUST_SAVE``."""
    for node in forward_nodes(graph):
        if kept_exactly(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE


JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]


class KeepExact:
    """AOTAutograd's joint-graph callback: the user's own first (``then``), then
    :func:`keep_exact`."""

    def __init__(self, first: JointPass | None = None) -> None:
        self.first = first

    def __call__(self, module: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        if self.first is not None:
            module = self.first(module, joint_inputs)
        keep_exact(module.graph)
        return module


def with_keep_exact(joint_pass: JointPass | None) -> KeepExact:
    """``torch._functorch.config.joint_custom_pass`` (None or the user's callable) with
    :func:`keep_exact` after it (once)."""
    if isinstance(joint_pass, KeepExact):
        return joint_pass
    return KeepExact(joint_pass)


__all__ = ["KeepExact", "forward_nodes", "keep_exact", "kept_exactly", "with_keep_exact"]
