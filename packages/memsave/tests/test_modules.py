"""The ``memsave`` strategy on whole models: exact, never above stock, in place, undoable."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.errors import NothingToRewriteWarning, OptionError
from torchstash.testing.models import zoo
from torchstash_memsave import (
    MemSave,
    MemSaveBatchNorm2d,
    MemSaveConv2d,
    MemSaveDropout,
    MemSaveMaxPool2d,
    MemSaveReLU,
)

ZOO = {e.name: e for e in zoo("tiny")}


def block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(4, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, padding_mode="reflect"),
        nn.GroupNorm(2, 8),
        nn.LeakyReLU(0.1),
        nn.MaxPool2d(3, 2, ceil_mode=True),
        nn.Dropout(0.2),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.LayerNorm(128),
        nn.ReLU6(),
        nn.Linear(128, 3),
    )


def _run(model: nn.Module, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, list[Any]]:
    torch.manual_seed(seed)  # dropout draws the same mask in both runs
    model.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    out = model(xs * 1)
    out.square().sum().backward()
    return out, [None if p.grad is None else p.grad.clone() for p in model.parameters()] + [xs.grad]


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_layer_family_in_one_model(channels_last: bool, dtype: torch.dtype) -> None:
    model = block().to(dtype)
    x = torch.randn(4, 4, 16, 16, dtype=dtype)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.to(memory_format=torch.channels_last)
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    state = copy.deepcopy(model.state_dict())
    out, grads = _run(model, x)
    stock_stats = copy.deepcopy(model.state_dict())
    model.load_state_dict(state)
    with ts.apply(model, "memsave") as handle:
        assert len(handle.rewrites) == 11  # every layer but Flatten and Linear
        assert all(isinstance(m, MemSave) for m in list(model)[:9])
        assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
        out2, grads2 = _run(model, x)
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    for k, v in model.state_dict().items():  # running statistics moved exactly as stock's
        assert torch.equal(v, stock_stats[k]), k
    assert not any(isinstance(m, MemSave) for m in model.modules())  # undone


def test_subclasses_are_matched_unless_they_override_forward() -> None:
    class MyConv(nn.Conv2d):
        pass

    class OddReLU(nn.ReLU):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(MyConv(3, 4, 3), OddReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    with ts.apply(model, "memsave") as handle:
        assert type(model[0]).__name__ == "MemSaveMyConv" and isinstance(model[0], MyConv)
        assert type(model[1]) is OddReLU
        rewriter = handle.plan.built[0].rewriters[0]
        assert any("overrides ReLU.forward" in why for why in rewriter.skipped)  # type: ignore[attr-defined]
    assert type(model[0]) is MyConv


def test_nothing_to_rewrite_is_a_warning_and_bad_flags_are_errors() -> None:
    with pytest.warns(NothingToRewriteWarning, match="found no module to rewrite"):
        ts.apply(nn.Sequential(nn.Linear(2, 2), nn.GELU()), "memsave").remove()
    with pytest.raises(OptionError, match="colour"):
        ts.apply(block(), "memsave", colour=True)
    with pytest.raises(OptionError, match="relu='yes'"):
        ts.apply(block(), "memsave", relu="yes")
    lazy = nn.Sequential(nn.LazyConv2d(4, 3), nn.ReLU())
    with ts.apply(lazy, "memsave") as handle:
        assert len(handle.rewrites) == 1  # the ReLU; the lazy conv waits for its first forward


def test_families_can_be_turned_off() -> None:
    model = block()
    with ts.apply(model, "memsave", relu=False, conv=False) as handle:
        kinds = {type(rw.replacement).__name__ for rw in handle.rewrites}
    assert not any("ReLU" in k or "Conv" in k for k in kinds)
    assert "MemSaveBatchNorm2d" in kinds


def test_from_nn_constructors_share_parameters_and_keep_arguments() -> None:
    conv = nn.Conv2d(3, 4, 3, padding="same", padding_mode="circular", bias=False)
    ms = MemSaveConv2d.from_nn_Conv2d(conv)
    assert ms.weight is conv.weight and ms.padding_mode == "circular" and ms.bias is None
    pool = nn.MaxPool2d(3, 2, ceil_mode=True)  # memsave_torch swapped these two arguments
    mp = MemSaveMaxPool2d.from_nn_MaxPool2d(pool)
    x = torch.randn(1, 3, 31, 31)
    assert mp.ceil_mode and not mp.return_indices and mp(x).shape == pool(x).shape
    bn = nn.BatchNorm2d(4, affine=False)
    mbn = MemSaveBatchNorm2d.from_nn_BatchNorm2d(bn)
    assert mbn.running_mean is bn.running_mean
    drop = MemSaveDropout.from_nn_dropout(nn.Dropout(0.3))
    assert drop.p == 0.3
    assert isinstance(MemSaveReLU.from_nn_ReLU(nn.ReLU(inplace=True)), nn.ReLU)
    with pytest.raises(TypeError, match="takes a Conv2d"):
        MemSaveConv2d.from_nn_Conv2d(nn.ReLU())
    y = ms(torch.randn(2, 3, 8, 8, requires_grad=True))
    assert torch.equal(y, conv(torch.randn(2, 3, 8, 8)) * 0 + y)  # runs and has the shape


def test_meta_and_half_precision() -> None:
    model = block().to("meta")
    with ts.apply(model, "memsave"):
        out = model(torch.empty(2, 4, 16, 16, device="meta", requires_grad=True))
    assert out.device.type == "meta" and out.shape == (2, 3)
    half = block().half()
    x = torch.randn(2, 4, 16, 16).half()
    _, ref = _run(half, x)
    with ts.apply(half, "memsave"):
        _, got = _run(half, x)
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("next_trains", [True, False])
def test_relu_mask_never_adds_to_a_tensor_the_next_layer_keeps(
    inplace: bool, next_trains: bool
) -> None:
    """Conv-BN-ReLU-Conv, everything trainable: the second conv keeps the ReLU's output as it
    is, so the ReLU's mask is dropped (no 1/32 beside it); with that conv frozen, the mask
    is all that is kept."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=inplace),
        nn.Conv2d(16, 16, 3, padding=1),
    )
    model[3].weight.requires_grad_(next_trains)
    x = torch.randn(4, 8, 16, 16)
    state = copy.deepcopy(model.state_dict())

    def step() -> None:
        model.zero_grad(set_to_none=True)
        model(x * 1).square().sum().backward()

    stock = ts.measure(model, step, "none", repeat=1, warmup=0)
    ref = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.load_state_dict(state)
    with ts.apply(model, "memsave") as handle:
        step()
        rows = handle.tally.rows
        stored = handle.tally.stored_bytes
    got = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    relu_out = 4 * 16 * 16 * 16 * 4
    if next_trains:
        assert stored <= stock.stored_bytes
        assert rows["2"].compressed == 0  # the mask gave way to the tensor itself
    else:
        assert rows["2"].compressed == 1 and rows["2"].stored_bytes == relu_out // 32
        assert stored == stock.stored_bytes - relu_out + relu_out // 32


@pytest.mark.parametrize("training", [True, False])
def test_sync_batch_norm_off_the_distributed_path(training: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU()).train(training)
    x = torch.randn(2, 3, 8, 8)
    state = copy.deepcopy(model.state_dict())
    _, ref = _run(model, x)
    moved = copy.deepcopy(model.state_dict())
    model.load_state_dict(state)
    with ts.apply(model, "memsave"):
        assert type(model[1]).__name__ == "MemSaveSyncBatchNorm"
        _, got = _run(model, x)
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in moved.items())


LAYERS: dict[str, tuple[Any, tuple[int, ...]]] = {
    "conv1d-same-replicate": (
        lambda: nn.Conv1d(4, 6, 4, padding="same", padding_mode="replicate"),
        (2, 4, 11),
    ),
    "conv3d-groups": (lambda: nn.Conv3d(4, 6, 3, stride=2, groups=2, dilation=1), (2, 4, 7, 7, 7)),
    "convT2d": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2, output_padding=1),
        (2, 4, 5, 5),
    ),
    "convT1d": (lambda: nn.ConvTranspose1d(4, 4, 3, stride=2), (2, 4, 9)),
    "bn1d-affine-off": (lambda: nn.BatchNorm1d(4, affine=False), (8, 4, 5)),
    "bn3d-no-stats": (lambda: nn.BatchNorm3d(4, track_running_stats=False), (2, 4, 3, 3, 3)),
    "bn2d-momentum-none": (lambda: nn.BatchNorm2d(4, momentum=None), (2, 4, 5, 5)),
    "rmsnorm": (lambda: nn.RMSNorm(6), (3, 5, 6)),
    "groupnorm": (lambda: nn.GroupNorm(2, 4, affine=True), (2, 4, 5)),
    "maxpool1d-indices": (
        lambda: nn.MaxPool1d(3, 2, 1, dilation=2, return_indices=True),
        (2, 4, 17),
    ),
    "maxpool3d-ceil": (lambda: nn.MaxPool3d(2, ceil_mode=True), (2, 3, 5, 5, 5)),
    "avgpool3d": (lambda: nn.AvgPool3d(2, divisor_override=3), (2, 3, 4, 4, 4)),
    "adaptive1d": (lambda: nn.AdaptiveAvgPool1d(3), (2, 3, 10)),
    "alphadropout": (lambda: nn.AlphaDropout(0.3), (4, 64)),
    "hardtanh": (lambda: nn.Hardtanh(-0.5, 0.7), (4, 64)),
    "leaky-inplace": (lambda: nn.LeakyReLU(0.2, inplace=True), (4, 64)),
}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", list(LAYERS))
def test_each_layer_as_a_module_matches_stock(name: str, training: bool) -> None:
    make, shape = LAYERS[name]
    torch.manual_seed(0)
    layer = make().train(training)
    x = torch.randn(*shape)
    state = copy.deepcopy(layer.state_dict())

    def run() -> list[Any]:
        torch.manual_seed(1)
        layer.zero_grad(set_to_none=True)
        xs = x.clone().requires_grad_()
        out = layer(xs * 1)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()
        return [out, xs.grad, *(p.grad for p in layer.parameters())]

    ref = run()
    moved = copy.deepcopy(layer.state_dict())
    layer.load_state_dict(state)
    with ts.apply(layer, "memsave") as handle:
        assert len(handle.rewrites) == 1 and isinstance(layer, MemSave)  # the model itself
        got = run()
    for a, b in zip(ref, got, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert all(torch.equal(v, layer.state_dict()[k]) for k, v in moved.items())
