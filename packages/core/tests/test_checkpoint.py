"""Activation checkpointing (``torch.utils.checkpoint``) under an applied strategy.

A non-reentrant checkpoint recomputes its forward in backward under its own saved-tensor hook
and matches what it saves there against the first forward. The engine used to activate on top
of that hook at the recomputation's first module call and take the tensors over, so backward
failed ("A different number of tensors was saved ... recomputation: 0"), even under ``none``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import torchstash as ts


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.head = nn.Linear(64, 64)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.head(x))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def _run(reentrant: bool, strategy: str | None) -> tuple[list[torch.Tensor], ts.Handle | None]:
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    handle = ts.apply(model, strategy) if strategy else None
    model(x).square().mean().backward()
    if handle is not None:
        handle.remove()
    return [p.grad for p in model.parameters() if p.grad is not None], handle


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_none_is_stock_bit_for_bit(reentrant: bool) -> None:
    stock, _ = _run(reentrant, None)
    got, handle = _run(reentrant, "none")
    assert len(got) == len(stock) and all(torch.equal(a, b) for a, b in zip(got, stock))
    assert handle is not None and handle.tally.raw_bytes > 0  # the head, outside the checkpoints
    # the recomputation's saves stay the checkpoint's (non-reentrant) or stock's (reentrant:
    # the block's own backward frees them next): only the head's and the inputs' count
    assert not [r for r in handle.tally.rows if r.startswith("blocks")]


def test_a_reentrant_recomputation_is_not_coded() -> None:
    """A code on the recomputed block's saves would cost a kernel each way and save nothing:
    they are freed by the block's backward, which runs right after."""
    pytest.importorskip("torchstash_quant")
    got, handle = _run(True, "quant.int8")
    assert handle is not None and all(g.isfinite().all() for g in got)
    assert not [r for r in handle.tally.rows if r.startswith("blocks")]
    assert sum(r.compressed for r in handle.tally.rows.values()) > 0  # the head, the inputs


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_offload_is_stock_bit_for_bit(reentrant: bool) -> None:
    stock, _ = _run(reentrant, None)
    got, handle = _run(reentrant, "offload.cpu")
    assert len(got) == len(stock) and all(torch.equal(a, b) for a, b in zip(got, stock))
    assert handle is not None and handle.tally.stored_bytes == handle.tally.raw_bytes
