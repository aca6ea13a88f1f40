"""What a compiled graph saves and what it recomputes, as the eager engine decides it.

**Kept exact.** With ``apply(..., compile_budget=)`` the partitioner recomputes the cheapest
values in backward from what it saves, and the strategy codes what it saves. A value
recomputed from a code is the code's, not stock's: a BatchNorm's statistics recomputed from its
coded input, or a ReLU's output (whose mask its backward reads) from a coded BatchNorm input.
The zoo's ResNet under ``quant.int4`` at budget 0.5 came to gradient cosine 0.72 with stock's
(eager 0.989). Those values are marked ``MUST_SAVE`` before the partitioner runs, as selective
checkpointing's policy would: statistics are small and kept exact, a ReLU's output keeps its
signs exact beside its code (:mod:`torchstash.graphhooks`). With it: 0.993.

**Recomputed as eager recomputes.** The eager engine keeps a GELU's, SiLU's, hardswish's or
LayerNorm's output as a recipe over its coded input (:mod:`torchstash.derive`): no bytes of
its own. Inductor's partitioner saves both (it does not recompute a value a non-fusible op
reads in backward, nor through a reduction), so each is coded: the zoo's GPT and ViT under
``quant.int8`` saved 1.96x eager's bytes. Their pointwise nodes are marked
``MUST_RECOMPUTE`` where the strategy's compressors recompute eagerly too
(:func:`torchstash.compressor.derives`): the output comes back from the coded input and the
exact statistics, as eagerly: 1.31x and 1.32x eager's bytes, the compiled step 1.41x -> 1.27x and 1.31x -> 1.19x
compiled stock's (one run, ``small`` zoo, inductor, one thread).

The pass runs as AOTAutograd's ``joint_custom_pass``, before any backend's partitioner
(inductor's, ``aot_eager_decomp_partition``'s, a custom backend's), after the user's own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .opnames import graph_op_names

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


#: torch-level ops whose output the eager engine recomputes from its coded input
#: (:data:`torchstash.derive.DERIVE_OPS`, less what recomputes a matmul or reads a mask)
RECOMPUTED_OPS = frozenset({"gelu", "silu", "hardswish", "layer_norm"})


def recomputed(node: torch.fx.Node) -> bool:
    """Whether ``node`` (a forward node's, not :func:`kept_exactly`) is a pointwise step of an
    op whose output eager recomputes (:data:`RECOMPUTED_OPS`, from ``source_fn_stack``)."""
    if node.op != "call_function":
        return False
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return False
    return graph_op_names(node)[0] in RECOMPUTED_OPS


_LAYER_NORMS = frozenset({aten.native_layer_norm.default})
#: ops that only view their first argument: a saved view is its base's value
VIEW_OPS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.reshape.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.alias.default,
        aten.detach.default,
    }
)


def eager_recomputes(node: torch.fx.Node) -> bool:
    """Whether a saved ``node`` (past views) is an output the eager engine recomputes: one
    marked :func:`recomputed` that the partitioner saved all the same, or a LayerNorm's output
    where the graph holds it undecomposed (``aot_eager``: one node, which no partitioner
    recomputes without its statistics' node)."""
    base = view_base(node)
    if base.meta.get("recompute") is CheckpointPolicy.MUST_RECOMPUTE:
        return True
    if base.op == "call_function" and base.target is operator.getitem and len(base.args) == 2:
        source, index = base.args
        return isinstance(source, torch.fx.Node) and source.target in _LAYER_NORMS and index == 0
    return False


def view_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose value ``node`` views (itself where it is no view)."""
    while node.op == "call_function" and node.target in VIEW_OPS and node.args:
        base = node.args[0]
        if not isinstance(base, torch.fx.Node):
            break
        node = base
    return node


def keep_exact(graph: torch.fx.Graph, recompute: bool = True) -> None:
    """Marks the :func:`kept_exactly` values of a joint graph's forward ``MUST_SAVE``, and
    with ``recompute`` the :func:`recomputed` ones ``MUST_RECOMPUTE``."""
    for node in forward_nodes(graph):
        if kept_exactly(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif recompute and recomputed(node):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]


class KeepExact:
    """AOTAutograd's joint-graph callback: the user's own first (``first``), then
    :func:`keep_exact` (recomputing where ``recompute``: the strategy's compressors let
    outputs be recomputed from their codes, :func:`~torchstash.compressor.derives`)."""

    def __init__(self, first: JointPass | None = None, recompute: bool = True) -> None:
        self.first = first
        self.recompute = recompute

    def __call__(self, module: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        if self.first is not None:
            module = self.first(module, joint_inputs)
        keep_exact(module.graph, self.recompute)
        return module


def with_keep_exact(joint_pass: JointPass | None, recompute: bool = True) -> KeepExact:
    """``torch._functorch.config.joint_custom_pass`` (None or the user's callable) with
    :func:`keep_exact` after it (once)."""
    if isinstance(joint_pass, KeepExact):
        joint_pass = joint_pass.first
    return KeepExact(joint_pass, recompute)


__all__ = [
    "RECOMPUTED_OPS",
    "eager_recomputes",
    "VIEW_OPS",
    "KeepExact",
    "forward_nodes",
    "keep_exact",
    "kept_exactly",
    "recomputed",
    "view_base",
    "with_keep_exact",
]
