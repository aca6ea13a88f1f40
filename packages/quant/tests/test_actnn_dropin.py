"""The ActNN drop-in: levels, QModule keeping the weights, layers under ActNN's names."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import torchstash as ts
import torchstash_quant.compat.actnn as actnn
from torchstash.errors import OptionError
from torchstash.testing.models import zoo

RESNET = next(e for e in zoo("tiny") if e.name == "resnet")


@pytest.fixture(autouse=True)
def _restore_level() -> Iterator[None]:
    yield
    actnn.set_optimization_level("L3")


def step(model: nn.Module) -> None:
    x, y = RESNET.batch(4, torch.device("cpu"))
    RESNET.loss(model, x, y).backward()


def test_qmodule_keeps_weights_and_keys() -> None:
    model = RESNET.build()
    keys, params = list(model.state_dict()), [id(p) for p in model.parameters()]
    actnn.set_optimization_level("L3")
    q = actnn.QModule(model)
    assert list(q.state_dict()) == keys
    assert [id(p) for p in q.parameters()] == params
    step(q)
    tally = q.handle.tally
    assert tally.raw_bytes > 5 * tally.stored_bytes
    assert q.remove() is model and ts.handle_of(model) is None


def test_levels_and_bits_override() -> None:
    sizes = {}
    for level in ("L0", "L2", "L3"):
        actnn.set_optimization_level(level)
        q = actnn.QModule(RESNET.build())
        step(q)
        sizes[level] = q.handle.tally.stored_bytes
        q.remove()
    assert sizes["L0"] > sizes["L2"] > sizes["L3"]
    actnn.set_optimization_level("L3")
    actnn.config.activation_compression_bits = [4, 8, 8]  # L3: an average of 4 bits
    q = actnn.QModule(RESNET.build())
    step(q)
    assert sizes["L3"] < q.handle.tally.stored_bytes <= sizes["L2"]


def test_unknown_level() -> None:
    with pytest.raises(OptionError, match="unknown ActNN level 'L9'"):
        actnn.set_optimization_level("L9")


def test_qavgpool_averages() -> None:
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(actnn.QAvgPool2d(2)(x), nn.functional.avg_pool2d(x, 2))
    assert not torch.equal(actnn.QAvgPool2d(2)(x), nn.functional.max_pool2d(x, 2))


class Shortcut(nn.Conv2d):
    """A user's own Conv2d subclass, with a forward of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + x


def convertible() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        Shortcut(8, 8, 3, padding=1),
        nn.Sequential(nn.MaxPool2d(2), nn.AvgPool2d(2), nn.ConvTranspose2d(8, 8, 1)),
        nn.Dropout(0.0),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


def grads(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def shown(model: nn.Module) -> list[str]:
    """The layer names ``print(model)`` shows, in order."""
    return re.findall(r"\): (\w+)\(", repr(model))


def test_printed_qmodule_shows_actnn_layers() -> None:
    """ActNN's README: ``print(model)`` to confirm the conversion, ``QConv2d``, ``QBatchNorm2d``
    and so on. The layers are ActNN's classes (and still torch's); keys, gradients and the
    level are unchanged, and ``remove()`` gives the torch classes back."""
    model, stock = convertible(), convertible()
    types = [type(m) for m in model.modules()]
    keys = list(model.state_dict())
    actnn.set_optimization_level("L0")  # nothing quantized: gradients are stock's, bit for bit
    q = actnn.QModule(model)
    assert shown(q) == [
        "Sequential", "QConv2d", "QBatchNorm2d", "QReLU", "QConv2d", "Sequential",
        "QMaxPool2d", "QAvgPool2d", "QConvTranspose2d", "Dropout", "Flatten", "QLinear",
    ]  # fmt: skip
    assert isinstance(model[0], actnn.QConv2d) and isinstance(model[1], nn.BatchNorm2d)
    assert isinstance(model[3], Shortcut) and isinstance(model[3], actnn.QConv2d)
    assert model[2].inplace and list(q.state_dict()) == keys
    assert all(torch.equal(a, b) for a, b in zip(grads(q), grads(stock), strict=True))
    assert q.remove() is model and [type(m) for m in model.modules()] == types
    assert ts.handle_of(model) is None and "Q" not in "".join(shown(model))


def test_converted_layers_run_the_models_level() -> None:
    """A converted layer keeps no block of its own: the model's level decides its saves, as
    on the torch layer. With ``enable_quantized_bn`` off (L1) BatchNorm stays, as in ActNN."""
    actnn.set_optimization_level("L2")
    model, stock = convertible(), convertible()
    name, options = actnn.conf.strategy(batchnorm=False)
    q = actnn.QModule(model)  # both built under the same torch seed: the same streams
    with ts.apply(stock, name, **options):
        expected = grads(stock)
    assert all(torch.equal(a, b) for a, b in zip(grads(q), expected, strict=True))
    assert not any(getattr(m, "_actnn_stash", None) for m in model.modules())
    q.remove()
    actnn.set_optimization_level("L1")
    q = actnn.QModule(model)
    assert shown(q)[1:4] == ["QConv2d", "BatchNorm2d", "QReLU"]
    q.remove()
