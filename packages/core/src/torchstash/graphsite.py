"""The site of a value a compiled graph saves for backward, read from the graph.

Eagerly, the engine names a saved tensor's :class:`~torchstash.site.Site` from the module
running and the op call saving it. In a compiled graph the saved-tensor hooks are traced once
per saved value, told its node in the forward graph (``_get_saved_tensor_hook_context``);
the node's graph gives the same names: the op that saves it (the op that made it, for an op
that saves its own output, such as a ReLU or a softmax; else the first op reading it, past
views), that op's torch-level name (``source_fn_stack``: ``linear``, ``layer_norm``...), the
value's role among the op's tensor arguments, and the module calling it
(``nn_module_stack``), so a policy line means the same thing compiled and eager.
"""

from __future__ import annotations

import operator
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
import torch.fx

from .engine.scope import NO_MODULE, ModuleInfo
from .errors import CompileFallbackWarning
from .opnames import graph_op_names
from .site import Site

aten = torch.ops.aten

#: ops that only view or reshape their first argument: the op saving a value may read it
#: through them
_VIEWS = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten.reshape,
        aten.permute,
        aten.transpose,
        aten.t,
        aten.expand,
        aten.select,
        aten.slice,
        aten.unsqueeze,
        aten.squeeze,
        aten.alias,
        aten.as_strided,
        aten.unbind,
        aten.split,
        aten.split_with_sizes,
        aten.clone,
        aten.contiguous,
    }
)

#: tuple-output ops whose first output their backward does not read (a norm's or a pool's
#: values: its statistics or indices are what it saves)
_STATS_SAVERS = frozenset(
    {
        aten.native_layer_norm,
        aten.native_batch_norm,
        aten._native_batch_norm_legit,
        aten._native_batch_norm_legit_functional,
        aten._native_batch_norm_legit_no_training,
        aten.max_pool2d_with_indices,
        aten.max_pool3d_with_indices,
    }
)

#: ops whose backward reads an output of theirs: a value they made is saved as their
#: ``output`` (for those above, not their first)
_OUTPUT_SAVERS = _STATS_SAVERS | frozenset(
    {
        aten.relu,
        aten.threshold,
        aten.sigmoid,
        aten.tanh,
        aten._softmax,
        aten._log_softmax,
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten.exp,
        aten.sqrt,
        aten.rsqrt,
    }
)

#: ops whose backward reads none of their tensor arguments: never the op saving a value
_NO_SAVE = frozenset(
    {aten.add, aten.sub, aten.neg, aten.cat, aten.stack, aten.copy, aten.sum, aten.mean}
)

#: aten ops whose tensor arguments come in another order than their torch-level call's:
#: aten position -> the role eager names (``F.linear(input, weight, bias)`` is
#: ``addmm(bias, input, weight.t())``)
_ROLES: dict[Any, dict[int, str]] = {aten.addmm: {0: "arg2", 1: "input", 2: "arg1"}}

#: what stands between trainable state and the copy of it an op saves (autocast's cast to
#: bf16, the transpose a linear reads)
_COPIES = _VIEWS | frozenset({aten._to_copy, torch.ops.prims.convert_element_type})

#: the AOTAutograd function that traces the saved-tensor hooks into the graphs
_HOOK_TRACER = "maybe_inline_graph_saved_tensors_hooks"

#: one warning a process where the tracer was not found
_UNSEEN: list[bool] = []

_INDEX = re.compile(r"\[(?:'([^']*)'|(\d+))\]")


def _packet(node: torch.fx.Node) -> Any:
    target = node.target
    return getattr(target, "overloadpacket", target)


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and (
        _packet(node) in _VIEWS or node.target is operator.getitem
    )


def _readers(
    node: torch.fx.Node, seen: set[torch.fx.Node] | None = None
) -> Iterator[tuple[torch.fx.Node, torch.fx.Node]]:
    """The ops reading ``node``'s value, past views and past ops that save nothing (a
    residual sum the partitioner recomputes in backward from its saved operands): (the op,
    the argument it reads)."""
    seen = set() if seen is None else seen
    for user in node.users:
        if user.op != "call_function" or user in seen:
            continue
        seen.add(user)
        if _is_view(user) or _packet(user) in _NO_SAVE:
            yield from _readers(user, seen)
        else:
            yield user, node


def _maker(node: torch.fx.Node) -> torch.fx.Node:
    """The op that made ``node``'s value (through the ``getitem`` of a tuple output, and the
    ``detach`` an in-place ReLU's saved output is)."""
    while node.op == "call_function" and (
        node.target is operator.getitem or _packet(node) in (aten.detach, aten.alias)
    ):
        source = node.args[0]
        if not isinstance(source, torch.fx.Node):
            break
        node = source
    return node


def _own_output(node: torch.fx.Node, made_by: torch.fx.Node) -> bool:
    """Whether ``node`` is an output its maker's backward reads."""
    if made_by.op != "call_function" or _packet(made_by) not in _OUTPUT_SAVERS:
        return False
    if _packet(made_by) not in _STATS_SAVERS:
        return True
    while node is not made_by and node.target is not operator.getitem:
        source = node.args[0]
        assert isinstance(source, torch.fx.Node)
        node = source
    return node is not made_by and node.args[1] != 0


def read_permutation(node: torch.fx.Node) -> tuple[int, ...] | None:
    """The dimensions of the ``permute`` through which the op saving ``node``'s value reads
    it (timm's ``LayerNorm2d`` normalizes ``x.permute(0, 2, 3, 1)``; eagerly the op saves
    that view), or None where it reads the value as is."""
    if _own_output(node, _maker(node)):
        return None
    for op, arg in _readers(node):
        if arg not in [a for a in op.args if isinstance(a, torch.fx.Node)]:
            continue
        if arg is not node and _packet(arg) is aten.permute and arg.args[0] is node:
            return tuple(int(d) for d in arg.args[1])
        return None
    return None


def relu_output(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value is a ReLU's output (through an in-place ReLU's ``detach``)."""
    made_by = _maker(node)
    return made_by.op == "call_function" and _packet(made_by) in (aten.relu, aten.relu_)


def saver(node: torch.fx.Node) -> tuple[torch.fx.Node | None, str]:
    """The op that saves ``node``'s value for backward and the value's role in it."""
    made_by = _maker(node)
    if _own_output(node, made_by):
        return made_by, "output"
    for op, arg in _readers(node):
        tensors = [a for a in op.args if isinstance(a, torch.fx.Node)]
        if arg not in tensors:
            continue
        i = tensors.index(arg)
        named = _ROLES.get(_packet(op))
        if named is not None and i in named:
            return op, named[i]
        return op, "input" if i == 0 else f"arg{i}"
    if made_by.op == "call_function" and _is_view(made_by):
        # read only in backward (``k.T`` for a matmul's gradient): named as what it views
        source = made_by.args[0]
        if isinstance(source, torch.fx.Node):
            return saver(source)
    if made_by.op == "call_function":
        return made_by, "output"
    return None, ""


#: a call entry's way back to its module in dynamo's path
_THROUGH_ENTRY = re.compile(r"\.(?:_call_impl|__call__)\.__self__")


def module_path(key: str) -> str:
    """A module's qualified name from dynamo's path of it (``L['self'].blocks[0].fc``; a
    module reached through a call entry's bound method, ``._call_impl.__self__``, is the
    module itself: :mod:`torchstash.modulecalls`)."""
    path = re.sub(r"^L\['[^']*'\]", "", key)
    path = _THROUGH_ENTRY.sub("", path)
    path = _INDEX.sub(lambda m: "." + (m.group(1) or m.group(2)), path)
    path = path.replace("._modules.", ".").replace("_modules.", "")
    return path.lstrip(".")


#: a module by its qualified name: the module and what the engine knows of it, or None
Lookup = Callable[[str], "tuple[torch.nn.Module, ModuleInfo] | None"]


def trainable_state(node: torch.fx.Node, fw_graph: torch.fx.Graph) -> bool:
    """Whether a saved value is trainable state or a copy of it, which the eager engine keeps
    as it is and outside the count (``engine/params.py``): a forward graph input, or made from
    one by views and casts only (autocast's bf16 copy of a weight, transposed for its matmul),
    where that input requires grad (a parameter, or a trainable leaf passed as an argument) or
    is a static input (a module's parameters and buffers, frozen ones too). The graph's hooks
    see the copies and the trainable leaves (``no_static`` leaves out only the static inputs
    themselves): int8 had coded a Linear's bf16 weight under autocast."""
    base = node
    while base.op == "call_function" and _packet(base) in _COPIES and base.args:
        source = base.args[0]
        if not isinstance(source, torch.fx.Node):
            return False
        base = source
    if base.op != "placeholder":
        return False
    meta = base.meta.get("tensor_meta")
    if meta is not None and meta.requires_grad:
        return True
    return base.name in _static_inputs(fw_graph)


def _static_inputs(fw_graph: torch.fx.Graph) -> set[str]:
    """The forward graph's static inputs by name, as AOTAutograd's ``no_static`` filter
    finds them. It tells the hooks nothing of them (their context is the graphs and the
    node), so they are read from the function tracing the hooks, which holds their indices
    among the graph's placeholders (``static_input_indices``); none where it is not found."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != _HOOK_TRACER:
        frame = frame.f_back
    indices = frame.f_locals.get("static_input_indices") if frame is not None else None
    if indices is None and not _UNSEEN:
        _UNSEEN.append(True)
        warnings.warn(
            f"torchstash: this torch's AOTAutograd traces the saved-tensor hooks outside "
            f"{_HOOK_TRACER}(static_input_indices=...), so the compiled graph cannot tell a "
            "frozen parameter's copy (autocast's bf16 weight) from an activation and codes it, "
            "where the eager engine keeps it exact. Apply the strategy without compiling, or "
            "use a torch where this is known to work (2.13, 2.14).",
            CompileFallbackWarning,
            stacklevel=2,
        )
    inputs = fw_graph.find_nodes(op="placeholder")
    return {inputs[i].name for i in indices or () if i < len(inputs)}


def site_of(node: torch.fx.Node, modules: Lookup) -> Site:
    """The :class:`Site` of the value ``node`` computes, as the eager engine would name it
    (no op call: a graph has none to hand over)."""
    op_node, role = saver(node)
    where = op_node if op_node is not None else node
    stack = list((where.meta.get("nn_module_stack") or {}).values())
    info, module = NO_MODULE, None
    if stack:
        key, cls = stack[-1]
        found = modules(module_path(str(key)))
        if found is not None:
            module, info = found
        else:  # a module the model does not hold (made in its forward): its type alone
            name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
            info = ModuleInfo(module_path(str(key)), "", name, -1, frozenset({name}))
    op, func = graph_op_names(op_node) if op_node is not None else ("", "")
    return info.site(
        op=op, func=func, role=role if op else "", training=bool(getattr(module, "training", True))
    )


__all__ = [
    "module_path",
    "read_permutation",
    "relu_output",
    "saver",
    "site_of",
    "trainable_state",
]
