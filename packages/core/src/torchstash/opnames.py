"""The names ops go by: a torch function's canonical name (what a policy's ``op =`` selects:
``conv`` for every ``conv*d``, ``matmul`` for ``mm``, ``bmm``, ``@``...) and its raw name, and
the names a policy commonly selects. Read by the tracker and by policies alike; imports
nothing of the engine."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CARRY_OPS", "KNOWN_OPS", "LAYOUT_OPS", "POINTWISE_OPS", "is_known_op", "op_names"]

# Raw function names that share one canonical op name.
_CANONICAL = {
    "mm": "matmul",
    "bmm": "matmul",
    "matmul": "matmul",
    "baddbmm": "matmul",
    "einsum": "matmul",
    "conv1d": "conv",
    "conv2d": "conv",
    "conv3d": "conv",
    "conv_transpose1d": "conv",
    "conv_transpose2d": "conv",
    "conv_transpose3d": "conv",
    "addmm": "linear",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "_softmax": "softmax",
    "batch_norm": "batch_norm",
    "sdpa": "scaled_dot_product_attention",
}

#: Canonical op names policies commonly select (others: any torch function's name).
KNOWN_OPS = frozenset(
    {
        "linear",
        "matmul",
        "conv",
        "softmax",
        "gelu",
        "silu",
        "hardswish",
        "relu",
        "layer_norm",
        "group_norm",
        "rms_norm",
        "batch_norm",
        "dropout",
        "embedding",
        "scaled_dot_product_attention",
        "max_pool",
        "avg_pool",
        "mul",
        "add",
        "tanh",
        "sigmoid",
    }
)

_names: dict[Any, tuple[str, str]] = {}


def op_names(func: Callable[..., Any]) -> tuple[str, str]:
    """(canonical, raw) names of a torch function, cached per function object."""
    hit = _names.get(func)
    if hit is None:
        raw = getattr(func, "__name__", None) or type(func).__name__
        base = raw.strip("_")
        if base.startswith("r") and raw.startswith("__r"):
            base = base[1:]  # __rmatmul__ -> matmul
        base = base.removesuffix("_")  # in-place variants (relu_) share the op
        for pool in ("max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"):
            if base.startswith(pool):
                base = pool.removeprefix("adaptive_")
        hit = (_CANONICAL.get(base, base), raw)
        _names[func] = hit
    return hit


def is_known_op(name: str) -> bool:
    """True for a canonical op name or the name of a function torch exposes."""
    if name in KNOWN_OPS or name in _CANONICAL:
        return True
    return any(
        hasattr(ns, name) or hasattr(ns, f"__{name}__")
        for ns in (torch, torch.Tensor, torch.nn.functional)
    )


_NUMBERED = re.compile(r"_\d+$")


def op_names_of_name(raw: str) -> tuple[str, str]:
    """(canonical, raw) for an op known only by name (``linear_2`` less its number)."""
    return _CANONICAL.get(raw, raw), raw


#: Torch functions dynamo keeps whole (one node of its graph) whose body eager sees as calls
#: of their own: ``nn.MultiheadAttention``'s. A graph op from one of them is named by its aten
#: op (:data:`_COMPOSITE_PARTS`), as eager names the inner call.
COMPOSITE_FUNCS = frozenset({"multi_head_attention_forward"})
#: aten ops inside a :data:`COMPOSITE_FUNCS` call, by the torch-level call eager sees: its
#: projections are ``linear`` (a 3-d input's is an ``mm`` and an ``add``), its attention
#: one ``scaled_dot_product_attention`` kernel
_COMPOSITE_PARTS = {
    "mm": "linear",
    "addmm": "linear",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_cudnn_attention": "scaled_dot_product_attention",
}


def graph_op_names(node: Any) -> tuple[str, str]:
    """(canonical op name, raw name) of a traced graph's op (a ``torch.fx.Node``), from the
    torch-level call it came from (``source_fn_stack``), else (or inside a
    :data:`COMPOSITE_FUNCS` call) its aten op's name."""
    stack = node.meta.get("source_fn_stack") or []
    if stack:
        name, fn = stack[-1]
        name = _NUMBERED.sub("", str(name))
        if callable(fn) and not isinstance(fn, type):
            try:
                name = op_names(fn)[1]
            except Exception:
                pass
            else:
                if name not in COMPOSITE_FUNCS:
                    return op_names(fn)
        if name in COMPOSITE_FUNCS:
            return _aten_names(node, _COMPOSITE_PARTS)
        return op_names_of_name(name)
    return _aten_names(node)


def _aten_names(node: Any, parts: dict[str, str] | None = None) -> tuple[str, str]:
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    raw = getattr(packet, "__name__", str(packet))
    if parts is not None and raw in parts:
        return parts[raw], raw
    return op_names_of_name(raw.lstrip("_"))


#: Functions that only view or copy their first argument's values in another layout: replayed
#: with the same arguments, they carry a recipe from their input to their output.
LAYOUT_OPS = frozenset(
    {
        "transpose",
        "swapaxes",
        "swapdims",
        "permute",
        "movedim",
        "reshape",
        "view",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "contiguous",
        "clone",
    }
)
#: Elementwise functions replayed on a recomputed argument, the others held as they were
#: (numbers, masks, scales: see :func:`replay_step`): a BatchNorm's output through the
#: (in-place) ReLU after it; ``q @ k.T`` through the scale, the mask and the softmax to the
#: attention map, and through the casts around them.
POINTWISE_OPS = frozenset(
    {
        "relu",
        "relu_",
        "mul",
        "mul_",
        "__mul__",
        "__rmul__",
        "__imul__",
        "div",
        "div_",
        "true_divide",
        "truediv",  # operator.truediv: a compiled graph's name for ``a / b``
        "__truediv__",
        "__itruediv__",
        "add",
        "add_",
        "__add__",
        "__radd__",
        "__iadd__",
        "sub",
        "sub_",
        "__sub__",
        "__isub__",
        "masked_fill",
        "masked_fill_",
        "where",
        "softmax",
        "to",
        "type",
        "float",
        "half",
        "bfloat16",
    }
)
#: Every function a recipe is carried through (the eager engine's recipes,
#: :mod:`torchstash.derive`; a compiled graph's recomputed attention, :mod:`torchstash.graphkeep`).
CARRY_OPS = LAYOUT_OPS | POINTWISE_OPS
