"""What memsave's layers cost beside stock's, pinned by mechanism (which ops and nodes run,
which calls reach the op tracker), never by time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import torchstash as ts
from torchstash.kernels import loader
from torchstash.optrack import OpTracker
from torchstash.signs import SignBits
from torchstash.site import Site
from torchstash_memsave import functional as MF
from torchstash_memsave.functional._tracker import apply
from torchstash_memsave.functional.act import RELU_MASK
from torchstash_memsave.functional.conv import ConvFunction
from torchstash_memsave.rewriter import MemSaveRewriter

aten = torch.ops.aten


class Ops(TorchDispatchMode):
    """Records each aten op run, with its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)

    def named(self, *funcs: Any) -> list[tuple[Any, tuple[Any, ...], dict[str, Any]]]:
        return [c for c in self.calls if c[0] in funcs]


@contextmanager
def tracker_calls_without_grad() -> Iterator[list[str]]:
    """The op tracker's calls made while grad mode is off: inside a Function's forward or the
    engine's pack hook, where it has nothing to do but costs a Python call each."""
    seen: list[str] = []
    original = OpTracker.__torch_function__

    def counting(self: OpTracker, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not torch.is_grad_enabled():
            seen.append(getattr(func, "__name__", repr(func)))
        return original(self, func, types, args, kwargs)

    OpTracker.__torch_function__ = counting  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        OpTracker.__torch_function__ = original  # type: ignore[method-assign]


def frozen_block() -> nn.Module:
    """memsave's Functions (a frozen conv, an eval BatchNorm with a frozen weight, a LeakyReLU,
    the pool, the dropout) beside stock's ops (the ReLU under the engine, a LayerNorm)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8).eval(),
        nn.ReLU(inplace=True),
        nn.LeakyReLU(0.1),
        nn.MaxPool2d(2),
        nn.Dropout(0.2),
        nn.Flatten(),
        nn.LayerNorm(128),
    )
    model[0].weight.requires_grad_(False)
    model[1].weight.requires_grad_(False)
    return model


def test_functions_and_their_saves_run_without_the_op_tracker() -> None:
    model = frozen_block()
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    with ts.apply(model, "memsave"), tracker_calls_without_grad() as seen:
        model(x).sum().backward()
    assert seen == []
    # the counter does see what a Function's apply under the tracker costs
    w = torch.randn(4, 3, 3, 3)
    conf = ([1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    with ts.stash("none"), tracker_calls_without_grad() as seen:
        ConvFunction.apply(x, w, None, *conf)
    assert seen
    with ts.stash("none"), tracker_calls_without_grad() as seen:
        apply(ConvFunction, x, w, None, *conf)
    assert seen == []


STOCK_NODES: list[tuple[str, Callable[[], nn.Module], tuple[int, ...], str, str]] = [
    ("conv", lambda: nn.Conv2d(4, 4, 3), (2, 4, 6, 6), "ConvolutionBackward0", "ConvFunction"),
    (
        "conv_transpose",
        lambda: nn.ConvTranspose2d(4, 4, 3),
        (2, 4, 6, 6),
        "ConvolutionBackward0",
        "ConvFunction",
    ),
    (
        "batch_norm",
        lambda: nn.BatchNorm2d(4),
        (2, 4, 6, 6),
        "NativeBatchNormBackward0",
        "BatchNormFunction",
    ),
    (
        "layer_norm",
        lambda: nn.LayerNorm(6),
        (2, 4, 6),
        "NativeLayerNormBackward0",
        "LayerNormFunction",
    ),
    (
        "group_norm",
        lambda: nn.GroupNorm(2, 4),
        (2, 4, 6, 6),
        "NativeGroupNormBackward0",
        "GroupNormFunction",
    ),
]


@pytest.mark.parametrize(
    ("make", "shape", "stock_node", "function"),
    [case[1:] for case in STOCK_NODES],
    ids=[case[0] for case in STOCK_NODES],
)
def test_a_layer_with_nothing_to_spare_runs_stocks_node(
    make: Callable[[], nn.Module], shape: tuple[int, ...], stock_node: str, function: str
) -> None:
    """Everything trainable, the Function would keep all stock keeps: stock's own node (no
    Python per call). Only the bias trainable, it keeps less: memsave's Function."""
    layer = make()
    MemSaveRewriter().rewrite(layer)
    x = torch.randn(shape, requires_grad=True)
    assert type(layer(x).grad_fn).__name__ == stock_node
    layer.weight.requires_grad_(False)
    out = layer(x.detach())
    assert type(out.grad_fn).__name__.startswith(function)


def test_engine_relu_is_stocks_node_with_its_save_coded() -> None:
    """Under the engine the ReLU is stock's op; its saved output is named memsave.relu, whose
    code (1 bit per element) the engine keeps where no later op keeps the tensor itself."""
    relu = nn.ReLU()
    MemSaveRewriter().rewrite(relu)
    x = torch.randn(8, 64, requires_grad=True)  # 2 KiB: above the engine's min_bytes
    with ts.stash("none") as block:
        y = relu(x * 1)
    assert type(y.grad_fn).__name__ == "ReluBackward0"
    assert sum(r.compressed for r in block.tally.rows.values()) == 1
    y.backward(torch.ones_like(y))
    assert x.grad is not None and torch.equal(x.grad, (x > 0).float())


def special(shape: tuple[int, ...]) -> torch.Tensor:
    """ReLU outputs with every edge a comparison could disagree on: NaN, +-0, inf, subnormal."""
    x = torch.randn(shape).relu_()
    flat = x.view(-1)
    flat[:6] = torch.tensor([math.nan, 0.0, -0.0, math.inf, 1e-45, 0.0])
    return x


def kernel_calls(ops: Ops) -> list[str]:
    """The names of the ops ``ops`` saw, the compiled kernels' as ``torchstash.<name>``."""
    return [str(c[0].overloadpacket) for c in ops.calls]


@pytest.fixture
def kernels() -> None:
    if not loader.available("cpu"):
        pytest.skip("compiled kernels unavailable")


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_relu_code_is_the_sign_code_one_kernel_each_way(
    dtype: torch.dtype, channels_last: bool
) -> None:
    x = special((2, 3, 4, 5)).to(dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    general = SignBits(RELU_MASK.name)
    with Ops() as ops:
        packed = RELU_MASK.compress(x, Site())
    assert [n for n in kernel_calls(ops) if "torchstash" in n or "aten.le" in n] == [
        "torchstash.sign_pack"
    ]
    want = general.compress(x, Site())
    assert torch.equal(packed.tensors["bits"], want.tensors["bits"])  # type: ignore[arg-type]
    assert packed.meta == want.meta and packed.codec == want.codec
    with Ops() as ops:
        restored = RELU_MASK.decompress(packed)
    assert "torchstash.sign_unpack" in kernel_calls(ops)
    assert not ops.named(aten._to_copy.default)  # no cast: the kernel writes the dtype
    expected = general.decompress(want)
    assert restored.dtype == expected.dtype and restored.stride() == expected.stride()
    assert torch.equal(restored, expected)


@pytest.mark.usefixtures("kernels")
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_mask_relu_takes_one_kernel_pass_each_way(inplace: bool, channels_last: bool) -> None:
    """No comparison or cast in forward (one kernel finds and packs the bits); in backward one
    kernel computes the gradient from them (no 1.0/0.0 tensor, no threshold_backward)."""
    x = special((2, 4, 3, 5))
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    x.requires_grad_()
    with Ops() as ops:
        y = MF.relu(x * 1, inplace=inplace)
    assert not ops.named(aten.le.Scalar, aten.bitwise_not.default, aten._to_copy.default)
    assert "torchstash.sign_pack" in kernel_calls(ops)
    grad = torch.randn(2, 4, 3, 5)
    if channels_last:
        grad = grad.to(memory_format=torch.channels_last)
    with Ops() as ops:
        y.backward(grad)
    kernels = [n for n in kernel_calls(ops) if n.startswith("torchstash.")]
    assert kernels == ["torchstash.sign_select"]
    assert not ops.named(
        aten._to_copy.default, aten.threshold_backward.default, aten.threshold_backward.grad_input
    )
    assert x.grad is not None
    want = aten.threshold_backward(grad, x.detach().relu(), 0)
    assert torch.equal(x.grad, want) and x.grad.stride() == want.stride()


def test_dropout_mask_by_a_cast() -> None:
    x = torch.randn(64, 32, requires_grad=True)
    with Ops() as ops:
        y = MF.dropout(x, 0.3, True)
    assert not ops.named(aten.ne.Scalar, aten.ne.Tensor)
    with Ops() as ops:
        y.backward(torch.ones_like(y))
    assert all(c[1][0].dtype != torch.bool for c in ops.named(aten._to_copy.default))
    assert x.grad is not None
    assert torch.equal(x.grad != 0, y != 0)


def test_stock_relu_backward_reads_the_code_as_the_output() -> None:
    """The engine hands stock's ReLU backward the restored 1.0/0.0: its gradient equals the
    one from the output itself, NaN included."""
    out = special((3, 7))
    grad = torch.randn(3, 7)
    restored = RELU_MASK.decompress(RELU_MASK.compress(out, Site()))
    assert torch.equal(
        aten.threshold_backward(grad, restored, 0), aten.threshold_backward(grad, out, 0)
    )
