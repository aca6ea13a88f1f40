"""Parameters and their copies are never activations: kept as they are, outside the count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..casts import CAST_NODES, copy_chain
from ..packed import storage_base

#: autograd nodes of a copy and of layout changes, between a parameter and its saved copy
_COPY_NODES = CAST_NODES | {"TBackward0", "TransposeBackward0", "PermuteBackward0"}


def parameter_copy(t: torch.Tensor, args: Sequence[Any]) -> bool:
    """A parameter in another dtype or layout (autocast's bf16 copy of a weight, transposed
    for the matmul): kept like the parameter itself, as is and outside the activations'
    count. At 2 bits such a copy took the bench zoo's ViT gradient cosine under bf16
    autocast from 0.99 to 0.72 (every input gradient is computed with it).

    A trainable parameter's copy is read from its graph, which ends at the parameter; a
    frozen one's has no graph, and is the running op's (``args``) Parameter argument of its size in
    another dtype (unless the op's first argument has that size too)."""
    if not t.is_floating_point():
        return False
    if t.grad_fn is not None:
        for node in copy_chain(t, _COPY_NODES):
            variable = getattr(node, "variable", None)
            if variable is not None:
                return isinstance(variable, torch.nn.Parameter)
        return False
    if t.requires_grad:
        return False
    for a in args:
        if isinstance(a, torch.nn.Parameter) and a.numel() == t.numel() and a.dtype != t.dtype:
            first = args[0] if args else None
            return not (
                isinstance(first, torch.Tensor) and first is not a and first.numel() == t.numel()
            )
    return False


def is_parameter(t: torch.Tensor, skip: set[int], args: Sequence[Any]) -> bool:
    """``t`` is trainable state, not an activation: a Parameter, a trainable leaf or a view
    of one, a tensor over a parameter's or buffer's storage (``skip``: their addresses), or
    autocast's copy of a weight (the running op's arguments ``args``)."""
    base = t._base
    return (
        isinstance(t, torch.nn.Parameter)
        or (t.requires_grad and t.is_leaf)
        or (base is not None and base.requires_grad and base.is_leaf)
        or storage_base(t) in skip
        or parameter_copy(t, args)
    )
