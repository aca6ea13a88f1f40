"""ActNN's levels as presets, and the GACT drop-in."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchstash as ts
import torchstash_quant.compat.gact as gact
from torchstash.errors import OptionError
from torchstash.testing.models import zoo

GPT = next(e for e in zoo("tiny") if e.name == "gpt")


def saved(strategy: str) -> ts.Report:
    model = GPT.build()
    x, y = GPT.batch(4, torch.device("cpu"))
    return ts.measure(model, lambda: GPT.loss(model, x, y).backward(), strategy, repeat=1, warmup=0)


def test_levels_are_registered_presets() -> None:
    names = {s["name"] for s in ts.strategies()}
    assert {f"quant.L{i}" for i in range(6)} <= names
    r0, r1, r2, r3, r4 = (saved(f"quant.L{i}") for i in range(5))
    assert r0.stored_bytes == r0.raw_bytes
    assert r2.stored_bytes == saved("quant.int4").stored_bytes
    assert r3.stored_bytes == saved("quant.auto").stored_bytes
    assert r4.stored_bytes == r3.stored_bytes  # on CPU the offload declines: nothing to move
    assert r3.stored_bytes < r2.stored_bytes < r1.stored_bytes < r0.stored_bytes


def test_level_1_takes_only_linear_and_conv_inputs() -> None:
    report = saved("quant.L1")
    for row in report.rows:
        if row.compressed:
            assert set(row.ops) <= {"linear", "conv"}, row
    gelu = next(r for r in report.rows if r.module_type == "GELU")
    assert gelu.compressed == 0 and any("only what conv, linear save" in k for k in gelu.declined)


def test_unknown_level_is_an_error() -> None:
    from torchstash_quant.strategies import level

    with pytest.raises(OptionError, match="L6"):
        level("L6")


def test_gact_controller_round_trip() -> None:
    model = GPT.build()
    x, y = GPT.batch(4, torch.device("cpu"))
    gact.set_optimization_level("L1.2")
    controller = gact.Controller(model)
    controller.install_hook()
    assert ts.handle_of(model) is controller.handle
    GPT.loss(model, x, y).backward()
    calls: list[int] = []
    controller.iterate(lambda: calls.append(1))
    assert controller.iter == 1 and calls == []
    tally = controller.handle.tally  # type: ignore[union-attr]
    assert tally.stored_bytes * 8 < tally.raw_bytes  # 2 bits, LayerNorm inputs at 8: 9.2x
    controller.uninstall_hook()
    assert ts.handle_of(model) is None
    gact.set_optimization_level("L1")


@pytest.mark.parametrize(("level", "budget"), [("L2", 4), ("L2.1", 3), ("L2.2", 2), ("L3", 4)])
def test_gact_adaptive_levels_are_auto(level: str, budget: int) -> None:
    model = GPT.build()
    x, y = GPT.batch(4, torch.device("cpu"))
    gact.set_optimization_level(level)
    controller = gact.Controller(model)
    controller.install_hook()
    try:
        for _ in range(2):
            GPT.loss(model, x, y).backward()
            controller.iterate(None)
        tally = controller.handle.tally  # type: ignore[union-attr]
        # Each step's tally: codes at about ``budget`` bits of every 32, plus scales.
        assert tally.raw_bytes / tally.stored_bytes > 32 / (budget + 1.5)
    finally:
        controller.uninstall_hook()
        gact.set_optimization_level("L1")


def test_gact_unknown_level() -> None:
    with pytest.raises(OptionError, match="unknown GACT level"):
        gact.set_optimization_level("L9")


def test_offloading_level_keeps_the_op_aware_codes() -> None:
    """L4 is L3 composed with an offload: the composition keeps L3's op-aware behaviour (a
    ReLU's sign bits are never shared with the next Linear, which needs the values), so on
    CPU, where the offload declines, its gradients are L3's bit for bit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU())
    x = torch.randn(32, 64)
    grads = []
    for level in ("quant.L3", "quant.L4"):
        model.zero_grad()
        with ts.apply(model, level, seed=0, min_bytes=0):
            model(x).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
