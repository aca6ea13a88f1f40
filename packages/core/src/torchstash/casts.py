"""Copies read from autograd's graph: which tensor a saved one is a cast or a view of.

Autocast casts an op's arguments inside the call, so what the op saves (a bf16 copy of a
Linear's float32 input, under CUDA's policy a float32 copy of a LayerNorm's bf16 input)
shares no storage with the argument. Its graph tells, exactly and without a pass over the
values: a dtype copy, then the views the op took of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

#: autograd nodes of a copy to another dtype and of views: a chain of them from ``t`` to
#: ``x`` makes ``t`` a view of ``x``'s cast
CAST_NODES = frozenset(
    {"ToCopyBackward0", "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"}
)

#: ... and the expand a batched ``matmul`` adds before its ``bmm`` (a view of the same size:
#: callers check the sizes match), between an attention map and the bf16 copy of it that
#: ``attn @ v`` saves under autocast when the softmax ran in float32 (CUDA's policy)
OPERAND_CAST_NODES = CAST_NODES | {"ExpandBackward0"}


def copy_chain(t: torch.Tensor, nodes: frozenset[str], depth: int = 3) -> Iterator[Any]:
    """The autograd nodes ``t`` was made from, one step back at a time, while each step is
    one of ``nodes`` (copies and views): at most ``depth`` of them."""
    node = t.grad_fn
    for _ in range(depth):
        if node is None or node.name() not in nodes or not node.next_functions:
            return
        node = node.next_functions[0][0]
        if node is None:
            return
        yield node


def cast_of(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether autograd made ``t`` from ``x`` by a dtype copy and views alone (the autocast
    cast of a projection's input, reshaped to 2-d; of a leaf, through its accumulator)."""
    if x.dtype == t.dtype or x.numel() != t.numel():
        return False
    target = x.grad_fn
    for node in copy_chain(t, OPERAND_CAST_NODES, depth=4):
        if node is target if target is not None else getattr(node, "variable", None) is x:
            return True
    return False
