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
(:func:`torchstash.compressor.recomputed_ops`): the output comes back from the coded input
and the exact statistics, as eagerly. So are attention's map and output, recomputed from the
coded ``q``, ``k``, ``v`` (:func:`recomputed_attention`), and a BatchNorm's output through the
ReLU after it, whose mask is saved exactly (:func:`split_relu`). The zoo's compiled
``quant.int8`` then saves 1.00x, 0.99x and 1.01x eager's bytes on the GPT, ViT and ResNet
(``python -m torchstash_bench.compiled``, ``small`` zoo, inductor, one thread).

The pass runs as AOTAutograd's ``joint_custom_pass``, before any backend's partitioner
(inductor's, ``aot_eager_decomp_partition``'s, a custom backend's), after the user's own.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .opnames import CARRY_OPS, graph_op_names

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
    return node.target in _MASKS or statistic(node)


def statistic(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a reduction's result or a normalization's statistic (a softmax's
    maximum and sum, a LayerNorm's mean and reciprocal deviation): small, kept exact."""
    if node.op != "call_function":
        return False
    if _reduces(node):
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


#: torch-level ops whose output the eager engine may recompute from its coded input
#: (:data:`torchstash.derive.DERIVE_OPS`): pointwise ones (:func:`recomputed`), and
#: ``matmul``, attention's products (:func:`recomputed_attention`); a strategy's compressors
#: say which they recompute (:func:`torchstash.compressor.recomputed_ops`)
RECOMPUTED_OPS = frozenset({"gelu", "silu", "hardswish", "layer_norm", "batch_norm", "matmul"})


def recomputed(node: torch.fx.Node, ops: Collection[str] = RECOMPUTED_OPS) -> bool:
    """Whether ``node`` (a forward node's, not :func:`kept_exactly`) is a pointwise step of an
    op of ``ops`` (from ``source_fn_stack``), whose output eager recomputes."""
    if node.op != "call_function":
        return False
    if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
        return False
    return graph_op_names(node)[0] in ops


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


def view_base(node: torch.fx.Node, steps: Collection[Any] = VIEW_OPS) -> torch.fx.Node:
    """The node whose value ``node`` views (itself where it is no view); with ``steps``,
    past those ops instead (copies too: :data:`_OPERAND_STEPS`)."""
    while node.op == "call_function" and node.target in steps and node.args:
        base = node.args[0]
        if not isinstance(base, torch.fx.Node):
            break
        node = base
    return node


#: matrix products as the graph holds them (``torch.matmul`` of 3-d or 4-d operands: ``bmm``)
_PRODUCTS = frozenset({aten.bmm.default, aten.mm.default})
#: what stands between a value and a product's operand made of it (a broadcast, a copy)
_OPERAND_STEPS = VIEW_OPS | {aten.clone.default, aten.contiguous.default}


def activation_product(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a ``matmul`` of two values computed in the forward (attention's
    ``q @ k.T`` and ``attn @ v``), not a layer's product with its weight (a graph input):
    the eager engine recomputes such a product's output from its two coded operands."""
    if node.op != "call_function" or node.target not in _PRODUCTS:
        return False
    if graph_op_names(node)[0] != "matmul":
        return False
    operands = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
    return len(operands) == 2 and all(
        view_base(a, _OPERAND_STEPS).op != "placeholder" for a in operands
    )


def _carried(node: torch.fx.Node) -> bool:
    """Whether a forward node carries a recomputed product to what reads it, as the eager
    engine's recipes are carried (:data:`torchstash.opnames.CARRY_OPS`): a view, a copy, or a
    pointwise step (the scale, the mask, the softmax's, a cast) that draws no random numbers."""
    if node.op != "call_function":
        return False
    if node.target in _OPERAND_STEPS:
        return True
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    canonical, raw = graph_op_names(node)
    if canonical == "softmax" and (torch.Tag.reduction in tags or node.target is operator.getitem):
        return True  # its maximum and sum: the map is recomputed whole, as eagerly
    if torch.Tag.pointwise not in tags:
        return False
    return canonical in CARRY_OPS or raw in CARRY_OPS


def recomputed_attention(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """The products of two forward values (:func:`activation_product`) and what carries them
    (:func:`_carried`) up to the next product: attention's map, recomputed from ``q`` and
    ``k`` through its scale, mask and softmax (its maximum and sum too: saved exactly they
    cost a sixth of a 2-bit map's code on the zoo's GPT), and its output, from the map and
    ``v`` through the layout copy the output projection reads, as the eager engine
    recomputes them (:mod:`torchstash.derive`)."""
    forward = set(nodes)
    found: set[torch.fx.Node] = set()
    todo = [n for n in nodes if activation_product(n)]
    while todo:
        node = todo.pop()
        if node in found:
            continue
        found.add(node)
        for user in node.users:
            if (
                user in forward
                and user not in found
                and (_carried(user) or activation_product(user))
            ):
                todo.append(user)
    return found


def _masks_of(relu: torch.fx.Node) -> list[torch.fx.Node] | None:
    """The ``<= 0`` comparisons that read ``relu``'s output (past aliases) in a joint graph:
    its backward's mask (``threshold_backward``, decomposed), which reads its signs. None
    where its signs are read otherwise (an undecomposed ``threshold_backward``, a comparison
    at another threshold, another ReLU); other readers (the next conv's weight gradient, a
    pool) read its values, which the recomputation restores as the eager engine's does."""
    masks: list[torch.fx.Node] = []
    todo = list(relu.users)
    while todo:
        user = todo.pop()
        if user.op != "call_function":
            return None
        if user.target in VIEW_OPS:
            todo.extend(user.users)
        elif user.target is aten.le.Scalar:
            if user.args[1] != 0:
                return None
            masks.append(user)
        elif user.target is aten.threshold_backward.default or user.target in _MASKS:
            return None
    return masks


def recomputed_relus(nodes: list[torch.fx.Node], marked: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """ReLUs of a recomputed value (a BatchNorm's output, ``marked``) whose backward reads
    their output through its ``<= 0`` mask only (:func:`_masks_of`)."""
    return {
        n
        for n in nodes
        if n.op == "call_function"
        and n.target in _MASKS
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0] in marked
        and _masks_of(n) is not None
    }


def _fake(target: Any, *args: Any) -> Any:
    """``target``'s value on the nodes' fake values (a new node's ``meta["val"]``)."""
    values = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    mode = next(v.fake_mode for v in values if hasattr(v, "fake_mode"))
    with mode:
        return target(*values)


def split_relu(graph: torch.fx.Graph, relu: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node]:
    """``relu(x)`` as ``where(x <= 0, 0, x)``, its backward's masks reading that ``x <= 0``:
    the mask is then a forward value, saved exactly (one bit each once coded), and the output
    may be recomputed from a code of ``x`` (the eager engine recomputes a BatchNorm's output
    through its ReLU and keeps the signs exact). Returns (mask, output)."""
    x = relu.args[0]
    masks = _masks_of(relu) or []
    with graph.inserting_before(relu):
        mask = graph.call_function(aten.le.Scalar, (x, 0))
        mask.meta.update(relu.meta)
        mask.meta["val"] = _fake(aten.le.Scalar, x, 0)
        out = graph.call_function(aten.where.ScalarSelf, (mask, 0.0, x))
        out.meta.update(relu.meta)
        out.meta["val"] = _fake(aten.where.ScalarSelf, mask, 0.0, x)
    relu.replace_all_uses_with(out)
    graph.erase_node(relu)
    for old in masks:
        old.replace_all_uses_with(mask)
        graph.erase_node(old)
    return mask, out


def declined_outputs(
    nodes: list[torch.fx.Node], marked: set[torch.fx.Node], declined: Collection[tuple[str, str]]
) -> set[torch.fx.Node]:
    """The ``marked`` nodes that end an op's steps and feed a reader which takes that op's
    output as its own saved input, not as a recomputation (``(op, reader)`` in
    ``declined``: a SiLU after a BatchNorm keeps its input at its own width)."""
    if not declined:
        return set()
    ending = set()
    for node in nodes:
        if node not in marked:
            continue
        op = graph_op_names(node)[0]
        for user in node.users:
            reader = graph_op_names(user)[0] if user.op == "call_function" else ""
            if reader != op and (op, reader) in declined:
                ending.add(node)
                break
    return ending


#: fused attention kernels: their backward reads their output, so the graph saves it
_ATTENTION_KERNELS = frozenset(
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(aten, name)
)


def attention_outputs(nodes: list[torch.fx.Node]) -> set[torch.fx.Node]:
    """A fused attention's outputs (``getitem`` 0 of its kernel), saved for its backward: the
    output projection's layout copy of it is recomputed from it (:func:`carried_copies`),
    where eager recomputes both from ``q``, ``k``, ``v``."""
    return {
        n
        for n in nodes
        if n.target is operator.getitem
        and n.args[1] == 0
        and isinstance(n.args[0], torch.fx.Node)
        and n.args[0].target in _ATTENTION_KERNELS
    }


def carried_copies(nodes: list[torch.fx.Node], marked: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """Views and layout copies of ``marked`` values (``nn.MultiheadAttention``'s projection
    reads a contiguous copy of its transposed input, a LayerNorm's output): recomputed with
    them, as eager carries a recipe through a layout step; else the partitioner saves the
    copy, coded as a value eager never stores."""
    forward = set(nodes)
    found: set[torch.fx.Node] = set()
    todo = [u for n in marked for u in n.users]
    while todo:
        node = todo.pop()
        if node in found or node in marked or node not in forward:
            continue
        if node.op != "call_function" or node.target not in _OPERAND_STEPS:
            continue
        found.add(node)
        todo.extend(node.users)
    return found


def keep_exact(
    graph: torch.fx.Graph,
    recompute: Collection[str] | bool = True,
    declined: Collection[tuple[str, str]] = (),
) -> None:
    """Marks the :func:`kept_exactly` values of a joint graph's forward ``MUST_SAVE``, and
    those of the ops in ``recompute`` (True: :data:`RECOMPUTED_OPS`) ``MUST_RECOMPUTE``:
    their :func:`recomputed` steps, with ``matmul`` the :func:`recomputed_attention`; a ReLU
    of a recomputed value (:func:`recomputed_relus`) is split (:func:`split_relu`), its mask
    saved and its output recomputed. An output a reader takes as its own (``declined``:
    :func:`declined_outputs`) is saved, so the reader's code keeps it."""
    ops = RECOMPUTED_OPS if recompute is True else frozenset(recompute or ())
    nodes = forward_nodes(graph)
    marked = {n for n in nodes if recomputed(n, ops) and not kept_exactly(n)}
    saved = declined_outputs(nodes, marked, declined)
    marked -= saved
    marked |= carried_copies(nodes, marked | attention_outputs(nodes))
    if "matmul" in ops:
        marked |= recomputed_attention(nodes)
    masks: set[torch.fx.Node] = set()
    for relu in recomputed_relus(nodes, marked):
        mask, out = split_relu(graph, relu)
        masks.add(mask)
        marked.add(out)
    if masks:
        nodes = forward_nodes(graph)
    for node in nodes:
        if node in masks or node in saved or (kept_exactly(node) and node not in marked):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif node in marked:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]


class KeepExact:
    """AOTAutograd's joint-graph callback: the user's own first (``first``), then
    :func:`keep_exact`, recomputing the outputs of the ops in ``recompute``: those the
    strategy's compressors recompute from their codes (:func:`~torchstash.compressor.recomputed_ops`)."""

    def __init__(
        self,
        first: JointPass | None = None,
        recompute: Collection[str] | bool = True,
        declined: Collection[tuple[str, str]] = (),
    ) -> None:
        self.first = first
        self.recompute = recompute
        self.declined = declined

    def __call__(self, module: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        if self.first is not None:
            module = self.first(module, joint_inputs)
        keep_exact(module.graph, self.recompute, self.declined)
        return module


def with_keep_exact(
    joint_pass: JointPass | None,
    recompute: Collection[str] | bool = True,
    declined: Collection[tuple[str, str]] = (),
) -> KeepExact:
    """``torch._functorch.config.joint_custom_pass`` (None or the user's callable) with
    :func:`keep_exact` after it (once)."""
    if isinstance(joint_pass, KeepExact):
        joint_pass = joint_pass.first
    return KeepExact(joint_pass, recompute, declined)


__all__ = [
    "RECOMPUTED_OPS",
    "eager_recomputes",
    "VIEW_OPS",
    "KeepExact",
    "attention_outputs",
    "carried_copies",
    "declined_outputs",
    "forward_nodes",
    "keep_exact",
    "kept_exactly",
    "recomputed",
    "recomputed_attention",
    "recomputed_relus",
    "split_relu",
    "statistic",
    "view_base",
    "with_keep_exact",
]
