"""Training steps for tests that hold a model under a strategy to a copy of it (stock, or the
full path on every step) bit for bit, across steps that may change what the forward saves:
shared by the plug-ins' suites, which may not import each other."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

#: A forward written out: the layer it runs and its input, to the output.
Forward = Callable[[nn.Linear, Tensor], Tensor]


def grads(model: nn.Module, x: Tensor) -> list[Tensor]:
    """One step of ``model(x).square().sum()`` from cleared gradients: copies of the gradients
    it left, on the parameters it reached, in ``model.parameters()``'s order."""
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_grads(model: nn.Module, reference: nn.Module, x: Tensor) -> None:
    """A step of ``reference`` on ``x``, then one of ``model``: ``model``'s gradients reach the
    same parameters and are ``reference``'s, bit for bit (dtype and shape included)."""
    want = grads(reference, x)
    got = grads(model, x)
    assert len(got) == len(want), f"gradients on {len(got)} parameters, expected {len(want)}"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class Switched(nn.Module):
    """One Linear layer ``fc`` run by ``usual(fc, x)``, or by ``switched(fc, x)`` while
    ``switch`` is set: a model whose forward saves other tensors on some steps (another op's,
    another layout) with the same parameters, for the guards of the engine's replay."""

    def __init__(self, fc: nn.Linear, usual: Forward, switched: Forward) -> None:
        super().__init__()
        self.fc = fc
        self.usual, self.switched = usual, switched
        self.switch = False

    def forward(self, x: Tensor) -> Tensor:
        return (self.switched if self.switch else self.usual)(self.fc, x)
