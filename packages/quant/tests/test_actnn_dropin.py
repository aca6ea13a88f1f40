"""The ActNN drop-in: levels, QModule keeping the weights, layers under ActNN's names."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import torchstash as ts
import torchstash_quant.compat.actnn as actnn
from torchstash.bench.zoo import zoo
from torchstash.errors import OptionError

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
