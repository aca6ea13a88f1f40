"""memsave_torch's users, one import line changed: their README call and their layer tests'
usage (``convert_to_memory_saving(layer, clone_params=True)``, every combination of input and
weight gradients, outputs and gradients compared), plus the functional API by its names."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchstash as ts
import torchstash_memsave.compat as memsave_torch
from torchstash_memsave.compat.nn.functional import (
    batch_normMemSave,
    conv1dMemSave,
    conv_transpose2dMemSave,
    convMemSave,
    dropoutMemSave,
    layer_normMemSave,
    linearMemSave,
    maxpool2dMemSave,
    reluMemSave,
    rms_normMemSave,
)


@dataclass
class Case:
    name: str
    layer_fn: Callable[[], nn.Module]
    data_fn: Callable[[], torch.Tensor]
    input_grads: tuple[bool, ...] = (False, True)
    wt_grads: tuple[bool, ...] = (False, True)


CASES = [
    Case("Linear1dims", lambda: nn.Linear(3, 5), lambda: torch.rand(7, 3)),
    Case("Linear2dims", lambda: nn.Linear(3, 5), lambda: torch.rand(7, 12, 3)),
    Case("Linear3dims", lambda: nn.Linear(3, 5), lambda: torch.rand(7, 12, 12, 3)),
    Case("Conv1d", lambda: nn.Conv1d(3, 5, 3), lambda: torch.rand(7, 3, 12)),
    Case("Conv2d", lambda: nn.Conv2d(3, 5, 3), lambda: torch.rand(7, 3, 12, 12)),
    Case("Conv3d", lambda: nn.Conv3d(3, 5, 3), lambda: torch.rand(7, 3, 12, 12, 12)),
    Case("ConvTranspose1d", lambda: nn.ConvTranspose1d(3, 5, 3), lambda: torch.rand(7, 3, 12)),
    Case("ConvTranspose2d", lambda: nn.ConvTranspose2d(3, 5, 3), lambda: torch.rand(7, 3, 12, 12)),
    Case(
        "ConvTranspose3d",
        lambda: nn.ConvTranspose3d(3, 5, 3),
        lambda: torch.rand(7, 3, 12, 12, 12),
    ),
    Case("BatchNorm2d", lambda: nn.BatchNorm2d(3), lambda: torch.rand(7, 3, 12, 12)),
    Case("LayerNorm", lambda: nn.LayerNorm([3, 12, 12]), lambda: torch.rand(7, 3, 12, 12)),
    Case("MaxPool2d", lambda: nn.MaxPool2d(3), lambda: torch.rand(7, 3, 12, 12), wt_grads=(False,)),
    Case("ReLU", lambda: nn.ReLU(), lambda: torch.rand(7, 3, 12, 12) - 0.5, wt_grads=(False,)),
    Case("Dropout", lambda: nn.Dropout(0.3), lambda: torch.rand(7, 3, 12), wt_grads=(False,)),
]


def _run(layer: nn.Module, x: torch.Tensor, input_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().detach()
    x.requires_grad = input_grad
    torch.manual_seed(1)  # the same dropout draws for both layers
    y = layer(x)
    if y.requires_grad:
        y.sum().backward()
    return y, x


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_their_layer_test_runs_unchanged(case: Case) -> None:
    torch.manual_seed(239)
    for input_grad, wt_grad in itertools.product(case.input_grads, case.wt_grads):
        layer = case.layer_fn()
        memsave_layer = memsave_torch.nn.convert_to_memory_saving(layer, clone_params=True)
        for p in itertools.chain(layer.parameters(), memsave_layer.parameters()):
            p.requires_grad_(wt_grad)
        x = case.data_fn()
        y1, x1 = _run(layer, x, input_grad)
        y2, x2 = _run(memsave_layer, x, input_grad)
        assert torch.equal(y1, y2)  # allclose upstream; bit for bit here
        if input_grad:
            assert x1.grad is not None and x2.grad is not None
            assert torch.equal(x1.grad, x2.grad)
        if wt_grad:
            for p1, p2 in zip(layer.parameters(), memsave_layer.parameters(), strict=True):
                assert p1 is not p2  # clone_params: the copy trains its own
                assert p1.grad is not None and p2.grad is not None
                assert torch.equal(p1.grad, p2.grad)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Identity(),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(8 * 4 * 4, 10),
    )


def test_readme_call_returns_a_converted_copy_sharing_parameters() -> None:
    """``model = convert_to_memory_saving(model)``: a converted copy, ``model`` untouched;
    the copy holds ``model``'s Parameters and buffers, so an optimizer built on either trains
    both, and the gradients are stock's."""
    original = model()
    converted = memsave_torch.nn.convert_to_memory_saving(original)
    assert converted is not original
    assert [type(m) for m in original] == [type(m) for m in model()]  # untouched
    assert isinstance(converted[0], memsave_torch.nn.MemSaveConv2d)
    assert isinstance(converted[1], memsave_torch.nn.MemSaveBatchNorm2d)
    assert isinstance(converted[2], memsave_torch.nn.MemSaveReLU)
    assert isinstance(converted[3], memsave_torch.nn.MemSaveMaxPool2d)
    assert isinstance(converted[6], memsave_torch.nn.MemSaveDropout)
    assert all(a is b for a, b in zip(original.parameters(), converted.parameters(), strict=True))
    assert all(a is b for a, b in zip(original.buffers(), converted.buffers(), strict=True))
    x = torch.randn(4, 3, 8, 8)
    torch.manual_seed(5)
    original(x).square().sum().backward()
    ref = [p.grad.clone() for p in original.parameters()]
    original.zero_grad()
    torch.manual_seed(5)
    converted(x).square().sum().backward()
    assert all(torch.equal(r, p.grad) for r, p in zip(ref, converted.parameters(), strict=True))
    ts.remove(converted)
    assert type(converted[0]) is nn.Conv2d


def test_clone_params_gives_an_independent_copy() -> None:
    original = model()
    converted = memsave_torch.nn.convert_to_memory_saving(original, clone_params=True)
    for a, b in zip(original.state_dict().values(), converted.state_dict().values(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_flags_turn_layers_off_one_dimension_at_a_time(capsys: pytest.CaptureFixture[str]) -> None:
    net = nn.Sequential(nn.Conv1d(2, 2, 1), nn.Conv2d(2, 2, 1), nn.ReLU(), nn.BatchNorm2d(2))
    converted = memsave_torch.nn.convert_to_memory_saving(
        net, conv2d=False, batchnorm2d=False, verbose=True
    )
    assert isinstance(converted[0], memsave_torch.nn.MemSaveConv1d)
    assert type(converted[1]) is nn.Conv2d and type(converted[3]) is nn.BatchNorm2d
    assert isinstance(converted[2], memsave_torch.nn.MemSaveReLU)
    assert capsys.readouterr().out.split("\n")[:2] == ["replaced 0", "replaced 2"]
    # nothing to convert: returned as a copy, as memsave_torch did, without a warning
    linear = nn.Sequential(nn.Linear(2, 2))
    assert type(memsave_torch.nn.convert_to_memory_saving(linear)[0]) is nn.Linear


def test_from_nn_constructors_and_recursive_setattr() -> None:
    net = model()
    conv = memsave_torch.nn.MemSaveConv2d.from_nn_Conv2d(net[0])
    assert conv.weight is net[0].weight
    linear = memsave_torch.nn.MemSaveLinear.from_nn_Linear(net[7])
    assert linear.weight is net[7].weight
    x = torch.randn(3, 128)
    assert torch.equal(linear(x), net[7](x))
    memsave_torch.nn.recursive_setattr(net, "7", linear, True)
    assert net[7] is linear and linear.weight is not conv.weight
    assert memsave_torch.nn.MemSaveDropout.from_nn_dropout(nn.Dropout(0.2)).p == 0.2


def _grads(fn: Callable[..., torch.Tensor], *args: object) -> list[torch.Tensor]:
    out = fn(*args)
    out.square().sum().backward()
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = [out.detach()] + [a.grad.clone() for a in leaves]  # type: ignore[union-attr]
    for a in leaves:
        a.grad = None
    return grads


def _same(
    ours: Callable[..., torch.Tensor], stock: Callable[..., torch.Tensor], *args: object
) -> None:
    torch.manual_seed(3)
    expected = _grads(stock, *args)
    torch.manual_seed(3)
    got = _grads(ours, *args)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_functional_names_take_upstreams_arguments_and_give_stocks_gradients() -> None:
    torch.manual_seed(0)
    x4 = torch.randn(2, 3, 8, 8, requires_grad=True)
    w4 = torch.randn(4, 3, 3, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    _same(
        lambda *a: convMemSave(*a, 1, 1, 1, 1, False, 0),
        lambda x, w, bb: F.conv2d(x, w, bb, 1, 1, 1, 1),
        x4,
        w4,
        b,
    )
    wt = torch.randn(3, 4, 3, 3, requires_grad=True)
    _same(
        lambda x, w, bb: conv_transpose2dMemSave(x, w, bb, 2, 1, 1),
        lambda x, w, bb: F.conv_transpose2d(x, w, bb, 2, 1, 1),
        x4,
        wt,
        b,
    )
    x3, w3 = torch.randn(2, 3, 9, requires_grad=True), torch.randn(4, 3, 3, requires_grad=True)
    _same(conv1dMemSave, F.conv1d, x3, w3, b)
    rm, rv = torch.zeros(3), torch.ones(3)
    g, beta = torch.rand(3, requires_grad=True), torch.randn(3, requires_grad=True)
    _same(
        lambda *a: batch_normMemSave(*a, True),
        lambda x, m, v, w, bb: F.batch_norm(x, m.clone(), v.clone(), w, bb, True),
        x4,
        rm,
        rv,
        g,
        beta,
    )
    _same(lambda x: dropoutMemSave(x, 0.3, True), lambda x: F.dropout(x, 0.3, True), x4)
    _same(lambda x: maxpool2dMemSave(x, 2), lambda x: F.max_pool2d(x, 2), x4)
    _same(reluMemSave, F.relu, x4)
    wl = torch.randn(5, 8, requires_grad=True)
    _same(linearMemSave, F.linear, x4, wl)
    w8 = torch.rand(8, requires_grad=True)
    _same(lambda x, w: layer_normMemSave(x, (8,), w), lambda x, w: F.layer_norm(x, (8,), w), x4, w8)
    _same(rms_normMemSave, lambda x, w: F.rms_norm(x, (8,), w, 1e-5), x4, w8)
    with pytest.raises(ValueError, match="conv1dMemSave: weight must be 3-D"):
        conv1dMemSave(x4, w4, None)


def test_a_model_under_torchstash_is_refused_with_what_to_do() -> None:
    """A copy would carry the applied hooks (the copy silently quantized by the original's
    engine): a clear error instead."""
    net = model()
    ts.apply(net[0], "none")
    with pytest.raises(ts.errors.ApplyError, match="applied to '0'.*torchstash.remove"):
        memsave_torch.nn.convert_to_memory_saving(net)
    ts.remove(net[0])
    assert memsave_torch.nn.convert_to_memory_saving(net) is not net
