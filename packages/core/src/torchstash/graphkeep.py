"""What a partitioner that recomputes under a memory budget must still save: the values the
eager engine keeps exact.

With ``apply(..., compile_budget=)`` inductor's partitioner recomputes the cheapest values in
backward from what it saves, and the strategy codes what it saves. A value recomputed from a
code is the code's, not stock's: a BatchNorm's statistics recomputed from its coded input, or a
ReLU's output (whose mask its backward reads) from a coded BatchNorm input. The zoo's ResNet
under ``quant.int4`` at budget 0.5 came to gradient cosine 0.72 with stock's (eager 0.989).
This joint-graph pass marks those values ``MUST_SAVE`` before the partitioner runs, as
selective checkpointing's policy would: statistics are small and kept exact, a ReLU's output
keeps its signs exact beside its code (:mod:`torchstash.graphhooks`). With it: 0.993.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
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
    """Whether ``node``'s value is one a recomputation from a code must not stand in for."""
    if node.op != "call_function":
        return False
    if node.target in _MASKS:
        return True
    if node.target is operator.getitem and len(node.args) == 2:
        source, index = node.args
        return isinstance(source, torch.fx.Node) and source.target in _NORMS and index in (1, 2)
    return False


class KeepExact(CustomGraphPass):
    """Marks :func:`kept_exactly` values of a joint graph ``MUST_SAVE``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if kept_exactly(node):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


KEEP_EXACT = KeepExact()


def with_keep_exact(passes: Any) -> tuple[Any, ...]:
    """The joint-graph pre-passes ``passes`` (inductor's config: None, one, or a sequence)
    with :data:`KEEP_EXACT` last."""
    if passes is None:
        return (KEEP_EXACT,)
    found = tuple(passes) if isinstance(passes, (list, tuple)) else (passes,)
    return found if KEEP_EXACT in found else (*found, KEEP_EXACT)


__all__ = ["KEEP_EXACT", "KeepExact", "kept_exactly", "with_keep_exact"]
