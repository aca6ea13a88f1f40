"""What memsave still keeps goes through the core's hooks: ``memsave>quant.int8`` rewrites the
layers and quantizes their saves (both plug-ins installed; neither imports the other)."""

from __future__ import annotations

import torch

import torchstash as ts
from torchstash.testing.models import zoo


def test_memsave_then_int8_on_the_resnet() -> None:
    entry = next(e for e in zoo("tiny") if e.name == "resnet")
    x, y = entry.batch(4, torch.device("cpu"))
    torch.manual_seed(0)
    model = entry.build()

    def step() -> None:
        model.zero_grad()
        entry.loss(model, x, y).backward()

    stock = ts.measure(model, step, "none", repeat=1)
    with ts.apply(model, "memsave") as handle:
        step()
        alone = handle.tally.stored_bytes
        ops = {op for r in handle.tally.rows.values() for op in r.ops}
    assert {"conv", "batch_norm"} <= ops  # memsave's Functions name their ops for the engine
    with ts.apply(model, "memsave>quant.int8") as handle:
        step()
        both = handle.tally.stored_bytes
        assert sum(r.compressed for r in handle.tally.rows.values()) > 0
        assert any(type(rw.replacement).__name__.startswith("MemSave") for rw in handle.rewrites)
    assert both < 0.5 * alone < alone <= stock.stored_bytes
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
