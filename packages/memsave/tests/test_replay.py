"""memsave under the engine's replay: the ReLU's 1-bit code replays without the op tracker, a
code a later save drops is never computed on a replayed step, and a code is never replayed
onto another op's save."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchstash as ts
from torchstash.testing.replay import tally_rows
from torchstash.testing.steps import Switched, assert_same_grads, grads
from torchstash_memsave import functional as MF


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )


def test_memsave_replays_its_relu_code_and_counts_as_recorded() -> None:
    torch.manual_seed(0)
    stock = cnn()
    model = copy.deepcopy(stock)
    x = torch.randn(4, 3, 16, 16)
    with ts.apply(model, "memsave") as handle:
        seen = []
        for _ in range(5):
            handle.tally.reset()
            assert_same_grads(model, stock, x)
            seen.append(tally_rows(handle.tally))
        replayer = handle.engine.replayer
        assert (replayer.recorded, replayer.replayed, replayer.missed) == (2, 3, 0)
        assert seen[0] == seen[1] == seen[4]
        # the last ReLU's output is coded (the pooling keeps nothing); the first one's is
        # kept as the conv after it keeps it
        assert sum(r[5] for r in seen[4].values()) == 1


def test_a_dropped_code_is_not_computed_when_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchstash_memsave.functional.act import ReLUMask

    calls = []
    original = ReLUMask.compress

    def counting(self: ReLUMask, x: torch.Tensor, site: ts.Site) -> object:
        calls.append(site.module)
        return original(self, x, site)

    monkeypatch.setattr(ReLUMask, "compress", counting)
    torch.manual_seed(0)
    model = cnn()
    x = torch.randn(4, 3, 16, 16)
    with ts.apply(model, "memsave") as handle:
        for _ in range(3):
            grads(model, x)
        assert handle.engine.replayer.replayed == 1
        calls.clear()
        grads(model, x)
    assert calls == ["4"]  # the ReLU before the pooling; not the one before the conv


def switches() -> Switched:
    """One position of the forward saves a ReLU's output or, switched, a tanh's, of the same
    shape."""
    return Switched(
        nn.Linear(16, 64),
        lambda fc, x: MF.relu(fc(x)).sum(-1),
        lambda fc, x: torch.tanh(fc(x)).sum(-1),
    )


def test_a_code_is_never_replayed_onto_another_ops_save() -> None:
    torch.manual_seed(0)
    stock = switches()
    model = copy.deepcopy(stock)
    x = torch.randn(32, 16)
    with ts.apply(model, "none") as handle:  # memsave.relu's own code applies under any plan
        for _ in range(3):
            assert_same_grads(model, stock, x)
        assert handle.engine.replayer.replayed == 1
        assert sum(r.compressed for r in handle.tally.rows.values()) > 0
        stock.switch = model.switch = True
        assert_same_grads(model, stock, x)
        assert handle.engine.replayer.missed == 1
