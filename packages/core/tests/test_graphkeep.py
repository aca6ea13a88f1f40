"""The joint-graph pass (:mod:`torchstash.graphkeep`) on graphs torch traced: which values it
marks saved or recomputed, its ReLU rewrite (exact, NaN included), and which ops a
strategy's compressors let the graph recompute."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from typing import Any

import pytest
import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

from torchstash.compressor import declined_readers, recomputed_ops
from torchstash.graphkeep import RECOMPUTED_OPS, forward_nodes, keep_exact, statistic
from torchstash.opnames import graph_op_names

aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def joint_graph(
    model: nn.Module,
    x: torch.Tensor,
    ops: Collection[str],
    declined: Collection[tuple[str, str]] = (),
) -> torch.fx.Graph:
    """``model``'s joint graph (``aot_eager_decomp_partition``: inductor's decompositions)
    after :func:`keep_exact` with ``ops`` and ``declined``."""
    found: list[torch.fx.Graph] = []

    def grab(module: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
        keep_exact(module.graph, ops, declined)
        found.append(module.graph)
        return module

    with functorch_config.patch(joint_custom_pass=grab):
        torch.compile(model, backend="aot_eager_decomp_partition")(x).sum().backward()
    assert len(found) == 1
    return found[0]


def marks(graph: torch.fx.Graph, policy: CheckpointPolicy) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.meta.get("recompute") is policy]


class Attention(nn.Module):
    """Hand-written causal attention: scale, mask, softmax, a product with the values."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.tril(torch.ones(64, 64, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
        scores = scores.masked_fill(~self.mask[:t, :t], float("-inf"))
        out = scores.softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, c))


def test_attention_s_map_and_output_are_recomputed_its_projections_are_not() -> None:
    torch.manual_seed(0)
    graph = joint_graph(Attention(), torch.randn(2, 16, 32), {"matmul"})
    recomputed = marks(graph, RECOMPUTE)
    targets = {n.target for n in recomputed}
    # both products of two forward values, the softmax's steps and its reductions
    assert sum(n.target is aten.bmm.default for n in recomputed) == 2, recomputed
    assert {aten.exp.default, aten.amax.default, aten.sum.dim_IntList} <= targets, targets
    # the projections' products read a weight: saved or recomputed as the partitioner likes
    assert aten.mm.default not in targets and aten.addmm.default not in targets
    # without matmul among the ops nothing of attention is marked
    torch._dynamo.reset()
    graph = joint_graph(Attention(), torch.randn(2, 16, 32), set())
    assert not marks(graph, RECOMPUTE)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.Flatten(),
    )


def test_a_batch_norm_s_relu_is_split_its_mask_saved_its_output_recomputed() -> None:
    graph = joint_graph(_cnn(), torch.randn(2, 3, 8, 8), {"batch_norm"})
    assert not [n for n in graph.nodes if n.target is aten.relu.default]
    (mask,) = [n for n in marks(graph, SAVE) if n.target is aten.le.Scalar]
    (out,) = [n for n in marks(graph, RECOMPUTE) if n.target is aten.where.ScalarSelf]
    assert out.args[0] is mask and mask.meta["val"].dtype == torch.bool
    # the backward's mask is the forward's: nothing reads the recomputed output's sign
    assert all(u.target is not aten.le.Scalar for u in out.users)
    # without batch_norm among the ops the ReLU stays, saved
    torch._dynamo.reset()
    graph = joint_graph(_cnn(), torch.randn(2, 3, 8, 8), set())
    assert [n for n in marks(graph, SAVE) if n.target is aten.relu.default]


def _grads(model: nn.Module, call: Callable[..., torch.Tensor], x: torch.Tensor) -> list[Any]:
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = call(x)
    out.sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_the_relu_rewrite_trains_as_stock_does(poison: float | None) -> None:
    """Marked and split, with nothing coded: the gradients are stock's (up to the float
    sums' order), a NaN or an Inf in the input goes where stock sends it."""
    model = _cnn()
    x = torch.randn(2, 3, 8, 8)
    if poison is not None:
        x[0, 1, 2, 3] = poison
    stock = _grads(model, model, x)

    def mark(module: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
        keep_exact(module.graph, RECOMPUTED_OPS)
        return module

    with functorch_config.patch(joint_custom_pass=mark):
        compiled = _grads(model, torch.compile(model, backend="aot_eager_decomp_partition"), x)
    for a, b in zip(stock, compiled, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_statistics_are_reductions_and_normalization_statistics() -> None:
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))
    graph = joint_graph(model, torch.randn(4, 16), set())
    found = {n.target for n in graph.nodes if statistic(n)}
    assert aten.var_mean.correction in found or aten.native_layer_norm.default in found, found
    assert not any(statistic(n) for n in graph.nodes if n.target is aten.addmm.default)


@pytest.mark.parametrize(
    ("strategy", "options", "batch_norm"),
    [
        ("quant.int8", {}, True),
        ("quant.int4", {}, True),
        ("quant.int2", {}, False),
    ],
)
def test_a_strategy_recomputes_what_its_eager_codes_let_it(
    strategy: str, options: dict[str, Any], batch_norm: bool
) -> None:
    """A BatchNorm's output is recomputed from its input's code at 4 bits and up (the eager
    engine's ``derivable``); with ``derive=False`` nothing is."""
    pytest.importorskip("torchstash_quant")
    import torchstash

    compressor = torchstash.REGISTRY.get(strategy).create(**options)
    ops = recomputed_ops(compressor, RECOMPUTED_OPS)
    assert ("batch_norm" in ops) is batch_norm
    assert {"gelu", "layer_norm", "matmul"} <= ops
    assert not recomputed_ops(
        torchstash.REGISTRY.get(strategy).create(derive=False), RECOMPUTED_OPS
    )


def _bn_silu() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.SiLU(inplace=True), nn.Conv2d(8, 8, 1)
    )


def _feeds(node: torch.fx.Node, op: str, reader: str) -> bool:
    return graph_op_names(node)[0] == op and any(
        graph_op_names(u)[0] == reader for u in node.users if u.op == "call_function"
    )


def test_a_batch_norm_s_output_a_silu_keeps_as_its_own_is_saved() -> None:
    """``(batch_norm, silu)`` declined: the BatchNorm's last step, which the SiLU reads, is
    saved (coded as the SiLU's input, as eagerly); the SiLU's own steps stay recomputed."""
    x = torch.randn(2, 3, 10, 10)
    graph = joint_graph(_bn_silu(), x, RECOMPUTED_OPS, {("batch_norm", "silu")})
    assert [n for n in marks(graph, SAVE) if _feeds(n, "batch_norm", "silu")]
    assert not [n for n in marks(graph, RECOMPUTE) if _feeds(n, "batch_norm", "silu")]
    assert [n for n in marks(graph, RECOMPUTE) if graph_op_names(n)[0] == "silu"]
    torch._dynamo.reset()
    graph = joint_graph(_bn_silu(), x, RECOMPUTED_OPS)
    assert [n for n in marks(graph, RECOMPUTE) if _feeds(n, "batch_norm", "silu")]


@pytest.mark.parametrize(
    ("strategy", "declined"),
    [
        ("quant.int8", set()),
        ("quant.int4", {("batch_norm", a) for a in ("gelu", "silu", "hardswish")}),
        ("quant.int2", set()),  # a BatchNorm's output is not recomputed at all
    ],
)
def test_a_strategy_declines_an_activation_s_input_below_its_act_bits(
    strategy: str, declined: set[tuple[str, str]]
) -> None:
    pytest.importorskip("torchstash_quant")
    import torchstash

    compressor = torchstash.REGISTRY.get(strategy).create()
    assert declined_readers(compressor, RECOMPUTED_OPS) == declined


class _Encoder(nn.Module):
    """A LayerNorm before ``nn.MultiheadAttention``, batch first (so its input is transposed
    and copied before the projection)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln(x)
        return self.attn(y, y, y, need_weights=False)[0]


def test_multihead_attention_s_parts_are_named_as_eager_names_them() -> None:
    """Dynamo keeps ``F.multi_head_attention_forward`` whole: its projections are named
    ``linear`` and its kernel ``scaled_dot_product_attention``, as the eager engine's sites;
    the projections' layout copies of a recomputed LayerNorm output and of the attention's
    output are recomputed with them, not saved as values of their own."""
    torch.manual_seed(0)
    graph = joint_graph(_Encoder(), torch.randn(2, 16, 32), RECOMPUTED_OPS)
    names = {graph_op_names(n)[0] for n in graph.nodes if n.op == "call_function"}
    assert {"linear", "scaled_dot_product_attention"} <= names, names
    assert "multi_head_attention_forward" not in names
    forward = forward_nodes(graph)
    products = [n for n in forward if n.target in (aten.mm.default, aten.addmm.default)]
    copies = [
        a
        for n in products
        for a in n.all_input_nodes
        if a.target in (aten.clone.default, aten.view.default, aten._unsafe_view.default)
        and a.args[0].op != "placeholder"
    ]
    assert copies and all(c.meta.get("recompute") is RECOMPUTE for c in copies), [
        (c, c.meta.get("recompute")) for c in copies
    ]
