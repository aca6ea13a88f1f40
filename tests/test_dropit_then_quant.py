"""dropit.mink's kept values compressed further by quant.int8 through the core's composition
(both plug-ins installed; neither imports the other)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchstash as ts


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mink_then_int8_at_gamma_09(dtype: torch.dtype) -> None:
    x = torch.randn(64, 128, 256).to(dtype).requires_grad_()
    layer = nn.Linear(256, 256).to(dtype)
    policy = [{"strategy": "dropit.mink>quant.int8", "options": {"dropit.mink": {"gamma": 0.9}}}]
    with ts.stash(policy=policy) as s:
        layer(x * 1.0).sum().backward()
    row = next(r for r in s.tally.rows.values() if r.module_type == "Linear")
    assert row.compressed == 1
    assert row.stored_bytes <= 0.12 * row.raw_bytes
    assert layer.weight.grad is not None and layer.weight.grad.isfinite().all()
